//! Router overhead: the latency a client sees for a 1-token request through the router
//! (validation, routing, Prefill, the chunk streamed back) versus the same Prefill sent straight
//! to the prefill node, alternating, on one `pdctl up` cluster of `synthetic:tiny`. The direct
//! request's lease is released after its timing ends (the router, too, releases it after the
//! client's stream has ended). Prints p50 / p99 of each and the difference.
//!
//! `BASELINE_ROUTER=/path/to/another/router` also times that router binary, started on the
//! same nodes, in the same alternation: before/after figures of a router change from one run.
//!
//! `cargo build --release --workspace --bins && cargo bench -p pd-tests --bench router_overhead`

use std::time::{Duration, Instant};

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use pd_tests::{Cluster, Process, client, collect, greedy, wait_serving};
use tonic::transport::Channel;

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One 1-token request through a router.
async fn through(router: &mut GenerationClient<Channel>, prompt: &[u32]) -> Duration {
    let t = Instant::now();
    collect(router, greedy(prompt.to_vec(), 1))
        .await
        .expect("router request");
    t.elapsed()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let cache = tempfile::tempdir().expect("tempdir");
    let cluster = Cluster::up(cache.path(), &[]).expect("pdctl up");
    let mut router = client(&cluster.router()).await;
    let prefill_addr = cluster.nodes("prefill")[0].clone();
    let decode_addr = cluster.nodes("decode")[0].clone();
    let baseline_bin = std::env::var("BASELINE_ROUTER").ok();
    let baseline = baseline_bin.as_deref().map(|bin| {
        Process::start(
            bin,
            cache.path(),
            &[
                "--model",
                "synthetic:tiny",
                "--prefill",
                &prefill_addr,
                "--decode",
                &decode_addr,
            ],
        )
        .expect("baseline router")
    });
    let mut baseline_client = None;
    if let Some(b) = &baseline {
        wait_serving(&b.addr())
            .await
            .expect("baseline router serving");
        baseline_client = Some(client(&b.addr()).await);
    }
    let mut prefill =
        pb::prefill_service_client::PrefillServiceClient::connect(format!("http://{prefill_addr}"))
            .await
            .expect("prefill node");
    let prompt: Vec<u32> = (1..9).collect();
    let (mut via_router, mut via_baseline, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n + 20 {
        let r = through(&mut router, &prompt).await;
        let b = match &mut baseline_client {
            Some(c) => Some(through(c, &prompt).await),
            None => None,
        };
        let t = Instant::now();
        let resp = prefill
            .prefill(pb::PrefillRequest {
                request_id: format!("direct-{i}"),
                token_ids: prompt.clone(),
                sampling: Some(pb::SamplingParams {
                    temperature: Some(0.0),
                    ..Default::default()
                }),
                cache_salt: None,
            })
            .await
            .expect("prefill")
            .into_inner();
        let d = t.elapsed();
        let lease = resp.kv.expect("kv handle").lease_id;
        prefill
            .release_kv(pb::ReleaseKvRequest { lease_id: lease })
            .await
            .expect("release");
        if i >= 20 {
            via_router.push(r);
            via_baseline.extend(b);
            direct.push(d);
        }
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (d50, d99) = (percentile(&mut direct, 0.5), percentile(&mut direct, 0.99));
    println!("1-token requests, synthetic:tiny, {n} each, alternating");
    println!(
        "  straight to the node      p50 {:8.0} us   p99 {:8.0} us",
        us(d50),
        us(d99)
    );
    let report = |name: &str, v: &mut Vec<Duration>| {
        let (p50, p99) = (percentile(v, 0.5), percentile(v, 0.99));
        println!(
            "  {name:<25} p50 {:8.0} us   p99 {:8.0} us   added p50 {:6.0} us   p99 {:6.0} us",
            us(p50),
            us(p99),
            us(p50) - us(d50),
            us(p99) - us(d99)
        );
    };
    report("through the router", &mut via_router);
    if let Some(bin) = &baseline_bin {
        report(&format!("through {bin}"), &mut via_baseline);
    }
    drop(baseline);
    cluster.stop();
}
