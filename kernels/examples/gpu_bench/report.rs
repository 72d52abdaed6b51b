//! The benchmark's results written out: `gpu_bench.json` (every figure) and `table.txt`
//! (the table printed last, then the GPU goals checked against the best variant measured
//! and which variant was fastest, to set the defaults of `PD_CUDA_GEMV`, `PD_CUDA_PDL` and
//! `--cuda-graphs` by). Written after every model, so a run cut short by the GPU host's time
//! limit still leaves the models it finished. Measures nothing itself.

use std::fmt::Write as _;
use std::path::Path;

use pd_kernels::cuda::plan::MIN_KEYS_PER_SPLIT;
use serde_json::{Value, json};

/// This card's two ceilings, measured first.
pub(crate) struct Ceilings {
    pub(crate) gpu: String,
    /// Bytes read plus written per second by a device-to-device copy.
    pub(crate) bandwidth: f64,
    /// FLOP/s of a large bf16 GEMM.
    pub(crate) flops: f64,
}

/// The decode variants measured, as (label, its fraction of the copy bandwidth in a decode
/// entry of the JSON).
const VARIANTS: [(&str, &str); 5] = [
    ("cuBLAS, eager", "bandwidth_fraction"),
    ("cuBLAS + graphs", "graphs_bandwidth_fraction"),
    ("gemv kernel, eager", "gemv_kernel_bandwidth_fraction"),
    (
        "gemv kernel + graphs",
        "gemv_kernel_graphs_bandwidth_fraction",
    ),
    (
        "gemv kernel + graphs + PDL",
        "gemv_kernel_graphs_pdl_bandwidth_fraction",
    ),
];

/// Issue 6's batch-1 decode goal for a model, as a fraction of the copy bandwidth: 80 % for
/// the 8B shape, 40 % for the 0.6B one (none for other models).
fn decode_goal(model: &str) -> Option<f64> {
    if model.ends_with("qwen3-8b") {
        Some(0.80)
    } else if model.ends_with("qwen3-0.6b") {
        Some(0.40)
    } else {
        None
    }
}

/// Issue 6's prefill goal: 2,048 tokens at 60 % of the GEMM rate.
const PREFILL_GOAL: (u64, f64) = (2048, 0.60);

/// Write `gpu_bench.json` and `table.txt` for the models measured so far; returns the table.
/// `moe`: the sparse layer's results ([`super::moe`]), once measured.
pub(crate) fn write(out: &Path, c: &Ceilings, results: &[Value], moe: Option<&Value>) -> String {
    let (gpu, bandwidth, flops) = (&c.gpu, c.bandwidth, c.flops);
    let report = json!({
        "gpu": gpu,
        "copy_bytes_per_s": bandwidth,
        "bf16_gemm_flops": flops,
        "models": results,
        "moe_layer": moe,
    });
    std::fs::create_dir_all(out).expect("out dir");
    let path = out.join("gpu_bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).expect("json")).expect("write");
    // The table (printed last; scripts/gpu-check.sh prints it again at its very end).
    let mut table = String::new();
    writeln!(
        table,
        "\n{gpu}: copy {:.0} GB/s (read + write), bf16 GEMM {:.0} TFLOP/s",
        bandwidth / 1e9,
        flops / 1e12
    )
    .expect("writing to a String");
    writeln!(
        table,
        "{:<22} {:<16} {:>12} {:>14} {:>10} {:>12} {:>12} {:>12}",
        "model", "phase", "tokens/s", "of ceiling", "graphs", "gemv kernel", "+ graphs", "+ PDL"
    )
    .expect("writing to a String");
    // A decode figure that may be absent: the graphs fell back, or the kernel takes no batch
    // this large.
    let maybe = |v: &Value, absent: &str| match v.as_f64() {
        Some(t) => format!("{t:.1}"),
        None => absent.to_string(),
    };
    for m in results {
        let name = m["model"].as_str().unwrap_or("?");
        for d in m["decode"].as_array().into_iter().flatten() {
            writeln!(
                table,
                "{:<22} {:<16} {:>12.1} {:>13.1}% {:>10} {:>12} {:>12} {:>12}",
                name,
                format!("decode b={}", d["batch"]),
                d["tokens_per_s"].as_f64().unwrap_or(0.0),
                100.0 * d["bandwidth_fraction"].as_f64().unwrap_or(0.0),
                maybe(&d["graphs_tokens_per_s"], "failed"),
                maybe(&d["gemv_kernel_tokens_per_s"], "-"),
                maybe(&d["gemv_kernel_graphs_tokens_per_s"], "-"),
                maybe(&d["gemv_kernel_graphs_pdl_tokens_per_s"], "-"),
            )
            .expect("writing to a String");
        }
        for p in m["prefill"].as_array().into_iter().flatten() {
            writeln!(
                table,
                "{:<22} {:<16} {:>12.1} {:>13.1}% {:>10}",
                name,
                format!("prefill {}", p["tokens"]),
                p["tokens_per_s"].as_f64().unwrap_or(0.0),
                100.0 * p["gemm_fraction"].as_f64().unwrap_or(0.0),
                "-"
            )
            .expect("writing to a String");
        }
        for a in m["attention"].as_array().into_iter().flatten() {
            writeln!(
                table,
                "{:<22} {:<16} {:>12.1} {:>13.1}% {:>10}",
                name,
                format!(
                    "attn {} {}",
                    a["tokens"],
                    a["kernel"].as_str().unwrap_or("?")
                ),
                a["tokens"].as_f64().unwrap_or(0.0) / (a["ms"].as_f64().unwrap_or(1.0) / 1e3),
                100.0 * a["gemm_fraction"].as_f64().unwrap_or(0.0),
                "-"
            )
            .expect("writing to a String");
        }
    }
    for m in results {
        let k = &m["kv_transfer"];
        writeln!(
        table,
            "{:<22} KV of a {}-token lease ({} blocks, {:.1} MB): device -> host {:.2} GB/s batched (page-locked, as a lease), {:.2} into heap memory, {:.2} one block at a time; host -> device {:.2} batched from page-locked import buffers ({:.2} through the import stream from another thread), {:.2} from heap memory, {:.2} one block at a time; the copy alone into pageable memory {:.2} GB/s, into page-locked {:.2}",
            m["model"].as_str().unwrap_or("?"),
            k["tokens"],
            k["blocks"],
            k["bytes"].as_f64().unwrap_or(0.0) / 1e6,
            k["out_batched_gb_s"].as_f64().unwrap_or(0.0),
            k["out_batched_heap_gb_s"].as_f64().unwrap_or(0.0),
            k["out_per_block_gb_s"].as_f64().unwrap_or(0.0),
            k["in_batched_pinned_gb_s"].as_f64().unwrap_or(0.0),
            k["in_import_stream_gb_s"].as_f64().unwrap_or(0.0),
            k["in_batched_gb_s"].as_f64().unwrap_or(0.0),
            k["in_per_block_gb_s"].as_f64().unwrap_or(0.0),
            k["dtoh_pageable_gb_s"].as_f64().unwrap_or(0.0),
            k["dtoh_pinned_gb_s"].as_f64().unwrap_or(0.0),
        )
        .expect("writing to a String");
    }
    for m in results {
        for d in m["decode"].as_array().into_iter().flatten() {
            let Some(by) = d["graphs_tokens_per_s_by_min_keys_per_split"].as_object() else {
                continue;
            };
            if by.is_empty() {
                continue;
            }
            let mut cells: Vec<(usize, String)> = by
                .iter()
                .map(|(k, v)| (k.parse().unwrap_or(0), maybe(v, "failed")))
                .collect();
            cells.sort();
            let cells: Vec<String> = cells.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            writeln!(
                table,
                "{:<22} decode b={} with graphs, tokens/s by the least keys per split (default {MIN_KEYS_PER_SPLIT}): {}",
                m["model"].as_str().unwrap_or("?"),
                d["batch"],
                cells.join(", ")
            )
            .expect("writing to a String");
        }
    }
    if let Some(moe) = moe {
        moe_lines(&mut table, moe);
    }
    writeln!(
        table,
        "(decode: fraction of the copy bandwidth, linear layers through cuBLAS; \"gemv kernel\": the same steps with PD_CUDA_GEMV=kernel, eager, with graphs, and with graphs and PD_CUDA_PDL=on; prefill: fraction of the GEMM rate, linear FLOPs only; attn: one layer's prefill attention alone, f32 CUDA cores or tensor cores, its FLOPs as a fraction of the GEMM rate; full results in {})",
        path.display()
    )
    .expect("writing to a String");
    goals(&mut table, results);
    std::fs::write(out.join("table.txt"), &table).expect("write the table");
    table
}

/// A line per batch of the MoE layer benchmark: device against host routing, as shares of
/// the copy bandwidth (decode batches: reading the chosen experts) or of the GEMM rate
/// (prefill batches: the experts' FLOPs).
fn moe_lines(table: &mut String, moe: &Value) {
    for b in moe["batches"].as_array().into_iter().flatten() {
        let f = |key: &str| b[key].as_f64().unwrap_or(0.0);
        let (ceiling, device, host) = if b["batch"].as_u64().unwrap_or(0) <= 128 {
            (
                "copy bandwidth",
                f("device_bandwidth_fraction"),
                f("host_bandwidth_fraction"),
            )
        } else {
            (
                "GEMM rate",
                f("device_gemm_fraction"),
                f("host_gemm_fraction"),
            )
        };
        writeln!(
            table,
            "MoE layer ({} experts of width {}, {} per token, hidden {}) b={}: {} experts ({:.1} MB); routed on the device {:.3} ms ({:.1}% of the {ceiling}, {} launches), on the host {:.3} ms ({:.1}%, {} launches): {:.2}x",
            moe["experts"],
            moe["expert_width"],
            moe["top_k"],
            moe["hidden"],
            b["batch"],
            b["experts_read"],
            f("weight_bytes") / 1e6,
            f("device_ms"),
            100.0 * device,
            b["device_launches"],
            f("host_ms"),
            100.0 * host,
            b["host_launches"],
            f("host_ms") / f("device_ms").max(1e-9),
        )
        .expect("writing to a String");
    }
}

/// The fastest decode variant of a decode entry: (label, fraction of the copy bandwidth).
fn fastest(d: &Value) -> Option<(&'static str, f64)> {
    VARIANTS
        .iter()
        .filter_map(|&(label, key)| d[key].as_f64().map(|f| (label, f)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// Under the table: each goal against the best variant measured, and the fastest decode
/// variant per batch (what the defaults should be).
fn goals(table: &mut String, results: &[Value]) {
    let verdict = |got: f64, goal: f64| if got >= goal { "met" } else { "NOT met" };
    writeln!(table, "goals (issue 6) and the fastest decode variants:")
        .expect("writing to a String");
    for m in results {
        let name = m["model"].as_str().unwrap_or("?");
        for d in m["decode"].as_array().into_iter().flatten() {
            let Some((label, best)) = fastest(d) else {
                continue;
            };
            let batch = d["batch"].as_u64().unwrap_or(0);
            match decode_goal(name).filter(|_| batch == 1) {
                Some(goal) => writeln!(
                    table,
                    "  {name} decode b=1 at >= {:.0}% of the copy bandwidth: {:.1}% ({label}): {}",
                    100.0 * goal,
                    100.0 * best,
                    verdict(best, goal)
                ),
                None => writeln!(
                    table,
                    "  {name} decode b={batch}: fastest {label} ({:.1}% of the copy bandwidth)",
                    100.0 * best
                ),
            }
            .expect("writing to a String");
        }
        let (tokens, goal) = PREFILL_GOAL;
        let prefill = m["prefill"].as_array().into_iter().flatten();
        for p in prefill.filter(|p| p["tokens"].as_u64() == Some(tokens)) {
            let got = p["gemm_fraction"].as_f64().unwrap_or(0.0);
            writeln!(
                table,
                "  {name} prefill {tokens} at >= {:.0}% of the GEMM rate: {:.1}%: {}",
                100.0 * goal,
                100.0 * got,
                verdict(got, goal)
            )
            .expect("writing to a String");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model's results with a batch-1 decode whose variants reach `fractions` (as
    /// [`VARIANTS`] lists them; `None`: not measured) and a 2,048-token prefill at `prefill`.
    fn model(name: &str, fractions: [Option<f64>; 5], prefill: f64) -> Value {
        let mut decode = json!({"batch": 1});
        for ((_, key), f) in VARIANTS.iter().zip(fractions) {
            decode[*key] = json!(f);
        }
        json!({
            "model": name,
            "decode": [decode],
            "prefill": [{"tokens": 2048, "gemm_fraction": prefill}, {"tokens": 8192, "gemm_fraction": 0.9}],
        })
    }

    #[test]
    fn goals_are_read_off_the_best_variant_measured() {
        let results = [
            model(
                "synthetic:qwen3-0.6b",
                [Some(0.12), Some(0.30), Some(0.15), Some(0.41), None],
                0.35,
            ),
            model(
                "synthetic:qwen3-8b",
                [Some(0.70), Some(0.79), Some(0.72), Some(0.78), Some(0.795)],
                0.61,
            ),
        ];
        let mut table = String::new();
        goals(&mut table, &results);
        let lines: Vec<&str> = table.lines().skip(1).map(str::trim).collect();
        assert_eq!(
            lines,
            [
                "synthetic:qwen3-0.6b decode b=1 at >= 40% of the copy bandwidth: 41.0% (gemv kernel + graphs): met",
                "synthetic:qwen3-0.6b prefill 2048 at >= 60% of the GEMM rate: 35.0%: NOT met",
                "synthetic:qwen3-8b decode b=1 at >= 80% of the copy bandwidth: 79.5% (gemv kernel + graphs + PDL): NOT met",
                "synthetic:qwen3-8b prefill 2048 at >= 60% of the GEMM rate: 61.0%: met",
            ]
        );
    }
}
