//! The keystone over RDMA, on a host with an RDMA device only: set `PD_TEST_RDMA_DEVICE`
//! (e.g. `rxe0` after `rdma link add rxe0 type rxe netdev eth0`, or `mlx5_0`), build the node
//! binaries with the feature (`cargo build --workspace --bins && cargo build -p prefill-node
//! -p decode-node --features rdma`) and run `cargo test -p pd-tests --test rdma -- --ignored`
//! (scripts/rdma-check.sh does). The test is `#[ignore]`d otherwise: the build machines have
//! no RDMA device and their kernel has no Soft-RoCE, so it has never run there
//! (docs/transport.md).
//!
//! Checked, with 1 + 1 and 2 + 2 nodes (`pdctl up --kv-transport rdma`, chunked prefill on):
//! greedy output through router → prefill → decode equals `pdctl run` token for token; every
//! block moved over RDMA (the decode nodes received KV, no read failed over to TCP, and the
//! prefill nodes' TCP export servers served nothing: RDMA reads are one-sided and invisible
//! to them); the prefill nodes offered every lease in place (registered KV memory, no
//! staging copy); afterwards every block on every node is free.

use pd_proto::pb;
use pd_tests::{
    Cluster, all_blocks_free, client, collect, greedy, nodes_sum, reference_tokens, spread_prompts,
};

/// The RDMA device the tests use (`PD_TEST_RDMA_DEVICE`, e.g. `rxe0`).
fn device() -> String {
    std::env::var("PD_TEST_RDMA_DEVICE")
        .ok()
        .filter(|d| !d.is_empty())
        .expect("PD_TEST_RDMA_DEVICE names the RDMA device to use")
}

/// Prompts of several lengths, most spanning several 16-token blocks.
fn prompts() -> Vec<Vec<u32>> {
    spread_prompts(6, 20, 29, 11)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device named by PD_TEST_RDMA_DEVICE: scripts/rdma-check.sh runs it"]
async fn keystone_over_rdma_equals_one_mixed_engine() {
    let dev = device();
    let cache = tempfile::tempdir().expect("tempdir");
    for (prefill, decode) in [("1", "1"), ("2", "2")] {
        let cluster = Cluster::up(
            cache.path(),
            &[
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--kv-transport",
                "rdma",
                "--",
                "--rdma-device",
                &dev,
                "--max-num-batched-tokens",
                "7",
            ],
        )
        .unwrap_or_else(|e| {
            panic!(
                "pdctl up --kv-transport rdma on {dev}: {e:#} (are the node binaries built \
                 with --features rdma?)"
            )
        });
        let mut c = client(&cluster.router()).await;
        for ids in prompts() {
            let want = reference_tokens(cache.path(), &ids, 12);
            let (got, last) = collect(&mut c, greedy(ids.clone(), 12))
                .await
                .expect("a stream");
            assert_eq!(
                got,
                want,
                "{prefill}+{decode}: prompt of {} tokens",
                ids.len()
            );
            assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        }
        let received = nodes_sum(&cluster, "decode", "pd_node_kv_transfer_bytes_total", &[]).await;
        let failovers = nodes_sum(
            &cluster,
            "decode",
            "pd_node_kv_transfer_failovers_total",
            &[],
        )
        .await;
        let over_tcp = nodes_sum(&cluster, "prefill", "pd_node_kv_transfer_bytes_total", &[]).await;
        // CPU nodes register their KV memory and offer leases where they lie (that needs
        // memlock room for all of it: raise `ulimit -l` if they staged).
        let offers = "pd_node_kv_rdma_offers_total";
        let in_place = nodes_sum(&cluster, "prefill", offers, &[("layout", "in_place")]).await;
        let staged = nodes_sum(&cluster, "prefill", offers, &[("layout", "staged")]).await;
        assert!(
            in_place > 0.0,
            "{prefill}+{decode}: leases offered in place"
        );
        assert_eq!(staged, 0.0, "{prefill}+{decode}: nothing staged");
        assert!(
            received > 0.0,
            "{prefill}+{decode}: the decode nodes received KV"
        );
        assert_eq!(
            failovers, 0.0,
            "{prefill}+{decode}: no RDMA read failed over"
        );
        assert_eq!(
            over_tcp, 0.0,
            "{prefill}+{decode}: the prefill nodes served nothing over TCP"
        );
        all_blocks_free(&cluster).await;
        assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
    }
}
