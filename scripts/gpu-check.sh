#!/usr/bin/env bash
# The CUDA backend on a GPU host, in one script (docs/cuda.md):
#   scripts/gpu-check.sh build          on the x86-64 build machine (has Rust): builds the
#                                       conformance test and the benchmark in release with the
#                                       `cuda` feature and puts them, stripped, in .gpu/bin/
#   scripts/gpu-check.sh run OUT_DIR    on the GPU host (CUDA 13 and a driver, no Rust):
#                                       (a) the conformance suite CUDA vs CPU (tiny model,
#                                       long-context split-K, a batch, the qwen3-0.6b shape,
#                                       device sampling vs the CPU's tokens, decode through
#                                       CUDA graphs vs eager decode, attention alone over head
#                                       shapes and KV types), once more with
#                                       PD_CUDA_ATTENTION=f32 (and the MoE model with
#                                       PD_CUDA_MOE=host) if it failed, and the
#                                       qwen3-0.6b checks with PD_CUDA_GEMV=kernel,
#                                       then with PD_CUDA_PDL=on too,
#                                       (b) the benchmark (copy and GEMM ceilings, decode at
#                                       batch 1/8/64 eagerly and with CUDA graphs, batches
#                                       1/8 again through the gemv16 kernels (eager,
#                                       graphs, graphs + PDL) and with graphs at finer
#                                       key splits (32/64/128 keys), prefill of
#                                       2,048 and 8,192 tokens, one layer's prefill attention
#                                       on each kernel) on synthetic:qwen3-0.6b and
#                                       synthetic:qwen3-8b, then one Qwen3-30B-A3B sparse
#                                       layer routed on the device against on the host,
#                                       (c) if time is left and compute-sanitizer is there,
#                                       memcheck over the tiny model's tests and racecheck
#                                       over the attention kernels' test and MoE routing,
#                                       (d) if time is left and ncu is there, one batch-1
#                                       decode step of qwen3-0.6b kernel by kernel, through
#                                       cuBLAS and through the gemv16 kernels.
#                                       Logs, gpu_bench.json, the sanitizer's reports and the
#                                       profiles go to OUT_DIR;
#                                       the benchmark's table is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.gpu/bin

case "${1:-}" in
build)
    mkdir -p "$bin"
    cargo build --locked --release -p pd-kernels --features cuda --example gpu_bench
    test_bin="$(cargo test --locked --release -p pd-kernels --features cuda --test gpu_conformance \
        --no-run --message-format=json 2>/dev/null \
        | sed -n 's/.*"executable":"\([^"]*gpu_conformance[^"]*\)".*/\1/p' | tail -1)"
    test -n "$test_bin" || { echo "no gpu_conformance test binary" >&2; exit 1; }
    cp "$test_bin" "$bin/gpu_conformance"
    cp target/release/examples/gpu_bench "$bin/gpu_bench"
    strip "$bin/gpu_conformance" "$bin/gpu_bench"
    ls -la "$bin"
    ;;
run)
    out="${2:?usage: scripts/gpu-check.sh run OUT_DIR}"
    mkdir -p "$out"
    test -x "$bin/gpu_conformance" || { echo "run 'scripts/gpu-check.sh build' first" >&2; exit 1; }
    # libcublas.so.13 and libnvrtc.so.13: a CUDA 13 toolkit, or the nvidia-* Python wheels.
    libs=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && libs="$libs:$d"
    done
    if py_nvidia="$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])' 2>/dev/null)"; then
        for d in "$py_nvidia"/cu13/lib "$py_nvidia"/*/lib; do
            [ -d "$d" ] && libs="$libs:$d"
        done
    fi
    export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PD_CACHE_DIR="${PD_CACHE_DIR:-/tmp/pd-cache}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true

    # Every stage has a time limit well past what it needs, so that one that hangs (a kernel
    # that never returns) leaves the later stages their time: the conformance suites 180 s,
    # the reruns 90 / 60 / 60 s; the benchmark gets what is left of 470 s (at least 60) and
    # writes its results after each model; the diagnostics (c) and (d) run only if they fit.
    echo "== (a) conformance: CUDA vs CPU"
    # The suite's tests are #[ignore]d (they need a GPU): --ignored runs them.
    set +e
    timeout 180 "$bin/gpu_conformance" --ignored --test-threads=1 --nocapture 2>&1 | tee "$out/conformance.log"
    conformance=${PIPESTATUS[0]}
    if [ "$conformance" -ne 0 ]; then
        # Tell a tensor-core attention defect from any other: the same suite on the f32
        # attention kernel only (docs/cuda.md, PD_CUDA_ATTENTION).
        echo "== (a') conformance again with PD_CUDA_ATTENTION=f32"
        PD_CUDA_ATTENTION=f32 timeout 90 "$bin/gpu_conformance" --ignored --test-threads=1 --nocapture \
            2>&1 | tee "$out/conformance-f32-attention.log"
        echo "conformance with f32 attention only: exit ${PIPESTATUS[0]}"
        # And a Qwen3-MoE defect from any other: the MoE model routed on the host.
        echo "== (a') the Qwen3-MoE model again with PD_CUDA_MOE=host"
        PD_CUDA_MOE=host timeout 60 "$bin/gpu_conformance" --ignored --test-threads=1 --nocapture \
            tiny_moe 2>&1 | tee "$out/conformance-moe-host.log"
        echo "the MoE model routed on the host: exit ${PIPESTATUS[0]}"
    fi
    # The bf16 model's checks again with the linear layers of decode steps through the
    # gemv16 kernel instead of cuBLAS (PD_CUDA_GEMV=kernel: the benchmark's "gemv kernel"
    # columns), so that its speed is only read off a kernel that computes the right thing.
    echo "== (a'') the qwen3-0.6b checks with PD_CUDA_GEMV=kernel"
    PD_CUDA_GEMV=kernel timeout 60 "$bin/gpu_conformance" --ignored --test-threads=1 --nocapture \
        qwen3_0_6b decode_graphs small_batch 2>&1 | tee "$out/conformance-gemv-kernel.log"
    gemv=${PIPESTATUS[0]}
    # And once more with the GEMV kernels launched programmatically dependent on the kernel
    # before them (PD_CUDA_PDL=on: the benchmark's "+ PDL" column): a kernel that read its
    # input before its wait would race with its predecessor here, which no emulator shows.
    echo "== (a''') the same with PD_CUDA_PDL=on"
    PD_CUDA_PDL=on PD_CUDA_GEMV=kernel timeout 60 "$bin/gpu_conformance" --ignored --test-threads=1 \
        --nocapture qwen3_0_6b decode_graphs norm_fused wide_rows 2>&1 | tee "$out/conformance-pdl.log"
    pdl=${PIPESTATUS[0]}
    echo "== (b) benchmark"
    left=$((470 - SECONDS))
    [ "$left" -ge 60 ] || left=60
    timeout "$left" "$bin/gpu_bench" "$out" synthetic:qwen3-0.6b synthetic:qwen3-8b 2>&1 \
        | tee "$out/bench.log"
    bench=${PIPESTATUS[0]}
    # (c) Memory errors and shared-memory races no emulator shows: compute-sanitizer (in the
    # GPU host's image; it works on a Firecracker machine) over the tiny model's tests
    # (every kernel of a layer, the split-K merge of a long context, a batch) with memcheck,
    # and over the attention kernels' test and a MoE routing test with racecheck
    # (shared-memory hazards in paged_attention, attention_mma and moe_route). Only if the 8 minutes leave room; a diagnostic,
    # its exit does not count: read "ERROR SUMMARY" in the logs.
    echo "== (c) compute-sanitizer: memcheck (tiny model), racecheck (attention)"
    sanitizer="$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer \
        /opt/nvidia/*/compute-sanitizer 2>/dev/null | tail -n 1 || true)"
    if [ -z "$sanitizer" ]; then
        echo "skipped: no compute-sanitizer on this host"
    elif [ "$SECONDS" -gt 270 ]; then
        echo "skipped: $SECONDS s of the 8 minutes used"
    else
        for check in "memcheck tiny_ batched_sequences" "racecheck attention_kernels router_ties"; do
            set -- $check
            tool="$1"
            shift
            timeout 45 "$sanitizer" --tool "$tool" --print-limit 20 \
                "$bin/gpu_conformance" --ignored --test-threads=1 "$@" >"$out/sanitizer-$tool.log" 2>&1
            echo "-- $tool over $*: exit $? ($out/sanitizer-$tool.log)"
            grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^test result|^=+ (Invalid|Error|Race)" \
                "$out/sanitizer-$tool.log" | head -n 20
        done
    fi
    # (d) Where one batch-1 decode step of qwen3-0.6b spends its time, kernel by kernel,
    # through cuBLAS and through the gemv16 kernels: Nsight Compute (in the GPU host's
    # image; on a Firecracker machine it reads the hardware timers) over `gpu_bench
    # --profile-decode`, which marks the step as the only profiled range. Only if the 8
    # minutes leave room; a diagnostic, its exit does not count.
    echo "== (d) one decode step, kernel by kernel (Nsight Compute)"
    ncu_bin="$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1 || true)"
    if [ -z "$ncu_bin" ]; then
        echo "skipped: no ncu on this host"
    elif [ "$SECONDS" -gt 330 ]; then
        echo "skipped: $SECONDS s of the 8 minutes used"
    else
        for linear in cublas kernel; do
            timeout 75 "$ncu_bin" --profile-from-start off --clock-control none \
                --metrics gpu__time_duration.sum --print-summary per-kernel \
                "$bin/gpu_bench" --profile-decode synthetic:qwen3-0.6b "$linear" \
                >"$out/profile-$linear.log" 2>&1
            echo "-- through $linear: exit $? ($out/profile-$linear.log)"
            tail -n 120 "$out/profile-$linear.log"
        done
    fi
    # The benchmark's table once more, last.
    [ -f "$out/table.txt" ] && cat "$out/table.txt"
    set -e
    echo "conformance exit $conformance, with the gemv16 kernels $gemv, with PDL $pdl, benchmark exit $bench"
    [ "$conformance" -eq 0 ] && [ "$gemv" -eq 0 ] && [ "$pdl" -eq 0 ] && [ "$bench" -eq 0 ]
    ;;
*)
    echo "usage: scripts/gpu-check.sh build | run OUT_DIR" >&2
    exit 2
    ;;
esac
