//! Router overhead: latency of a 1-token request through the router (validation, routing,
//! Prefill, lease release) versus the same Prefill + ReleaseKv sent straight to the prefill
//! node, alternating, on one `pdctl up` cluster of `synthetic:tiny`. Prints p50 / p99 of both
//! and the difference.
//!
//! `cargo build --release --workspace --bins && cargo bench -p pd-tests --bench router_overhead`

use std::time::{Duration, Instant};

use pd_proto::pb;
use pd_tests::{Cluster, client, collect, greedy};

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
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
    let mut prefill =
        pb::prefill_service_client::PrefillServiceClient::connect(format!("http://{prefill_addr}"))
            .await
            .expect("prefill node");
    let prompt: Vec<u32> = (1..9).collect();
    let (mut via_router, mut direct) = (Vec::new(), Vec::new());
    for i in 0..n + 20 {
        let t = Instant::now();
        collect(&mut router, greedy(prompt.clone(), 1))
            .await
            .expect("router request");
        let r = t.elapsed();
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
        let lease = resp.kv.expect("kv handle").lease_id;
        prefill
            .release_kv(pb::ReleaseKvRequest { lease_id: lease })
            .await
            .expect("release");
        let d = t.elapsed();
        if i >= 20 {
            via_router.push(r);
            direct.push(d);
        }
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (r50, r99) = (
        percentile(&mut via_router, 0.5),
        percentile(&mut via_router, 0.99),
    );
    let (d50, d99) = (percentile(&mut direct, 0.5), percentile(&mut direct, 0.99));
    println!("1-token requests, synthetic:tiny, {n} each, alternating");
    println!(
        "  through the router   p50 {:8.0} us   p99 {:8.0} us",
        us(r50),
        us(r99)
    );
    println!(
        "  straight to the node p50 {:8.0} us   p99 {:8.0} us",
        us(d50),
        us(d99)
    );
    println!(
        "  added by the router  p50 {:8.0} us   p99 {:8.0} us",
        us(r50) - us(d50),
        us(r99) - us(d99)
    );
    cluster.stop();
}
