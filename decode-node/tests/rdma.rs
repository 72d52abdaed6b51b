//! The prefill → decode path over RDMA, on a host with an RDMA device only: set
//! `PD_TEST_RDMA_DEVICE` (e.g. `rxe0` after `rdma link add rxe0 type rxe netdev eth0`, or
//! `mlx5_0`) and run `cargo test -p decode-node --features rdma --test rdma -- --ignored`
//! (scripts/rdma-check.sh does). The test is `#[ignore]`d otherwise: the build machines have
//! no RDMA device and their kernel has no Soft-RoCE, so this file has never run there
//! (docs/transport.md).
//!
//! Checked: the prefill node offers the lease over RDMA where its KV lies (in place: the
//! CPU backend's KV memory is registered; needs `ulimit -l` room for it), the decode node
//! reads it (no failover), and the greedy tokens equal those of the same request moved over
//! TCP.

use std::time::Duration;

use clap::Parser;
use decode_node::DecodeArgs;
use pd_proto::pb;
use pd_proto::pb::decode_service_client::DecodeServiceClient;
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use pd_test_support::{cache, metrics};
use prefill_node::PrefillArgs;
use tokio::sync::oneshot;

/// The RDMA device the test uses (`PD_TEST_RDMA_DEVICE`, e.g. `rxe0`).
fn device() -> String {
    let dev = std::env::var("PD_TEST_RDMA_DEVICE")
        .expect("PD_TEST_RDMA_DEVICE names the RDMA device to use");
    if !pd_transport::rdma::BUILT {
        panic!("PD_TEST_RDMA_DEVICE is set: run with --features rdma");
    }
    dev
}

/// A prefill and a decode node in this process with `flags`; the stop senders and the
/// decode node's metrics address.
async fn pair(
    flags: &[&str],
) -> (
    String,
    String,
    std::net::SocketAddr,
    Vec<oneshot::Sender<()>>,
) {
    let argv = |bin: &'static str| std::iter::once(bin).chain(flags.iter().copied());
    let mut pa = PrefillArgs::try_parse_from(argv("prefill-node")).unwrap();
    pa.node.synthetic_cache_dir = Some(cache().to_path_buf());
    let mut da = DecodeArgs::try_parse_from(argv("decode-node")).unwrap();
    da.node.synthetic_cache_dir = Some(cache().to_path_buf());
    let p = prefill_node::start(pa).await.expect("prefill node starts");
    let d = decode_node::start(da).await.expect("decode node starts");
    let (purl, durl) = (
        format!("http://{}", p.ready().grpc),
        format!("http://{}", d.ready().grpc),
    );
    let metrics = d.ready().metrics_addr;
    let kv_addr = p.ready().kv.expect("a KV address").to_string();
    let (ps, pr) = oneshot::channel::<()>();
    let (ds, dr) = oneshot::channel::<()>();
    tokio::spawn(p.run(async {
        let _ = pr.await;
    }));
    tokio::spawn(d.run(async {
        let _ = dr.await;
    }));
    // The router's job: tell the decode node the prefill node it may pull from.
    DecodeServiceClient::connect(durl.clone())
        .await
        .unwrap()
        .set_kv_peers(pb::SetKvPeersRequest {
            kv_addrs: vec![kv_addr],
        })
        .await
        .unwrap();
    (purl, durl, metrics, vec![ps, ds])
}

/// Prefill then decode `tokens`; the tokens and how the handle offered RDMA ([`offer_layout`]).
async fn generate(purl: &str, durl: &str, tokens: &[u32]) -> (Vec<u32>, Option<bool>) {
    let greedy = pd_test_support::greedy();
    let mut prefill = PrefillServiceClient::connect(purl.to_string())
        .await
        .unwrap();
    let r = prefill
        .prefill(pd_test_support::prefill_request("r", tokens.to_vec()))
        .await
        .unwrap()
        .into_inner();
    let kv = r.kv.clone().unwrap();
    let first = r.first_token.unwrap().token_id;
    let mut stream = DecodeServiceClient::connect(durl.to_string())
        .await
        .unwrap()
        .decode(pb::DecodeRequest {
            request_id: "r".into(),
            prompt_token_ids: tokens.to_vec(),
            first_token: first,
            sampling: greedy,
            max_tokens: 8,
            stop_token_ids: vec![],
            ignore_eos: true,
            cache_salt: None,
            kv: Some(kv.clone()),
            resumed_tokens: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = vec![first];
    while let Some(m) = stream.message().await.unwrap() {
        out.extend(m.tokens.iter().map(|t| t.token_id));
    }
    prefill
        .release_kv(pb::ReleaseKvRequest {
            lease_id: kv.lease_id,
            lease_secret: kv.lease_secret.clone(),
        })
        .await
        .unwrap();
    (out, offer_layout(&kv.rdma))
}

/// How the prefill node offered the lease: `None` for no RDMA offer, else whether in place.
fn offer_layout(rdma: &[u8]) -> Option<bool> {
    if rdma.is_empty() {
        return None;
    }
    let offer = pd_transport::rdma::RdmaOffer::decode(rdma).expect("a valid RDMA offer");
    Some(matches!(
        offer.layout,
        pd_transport::rdma::OfferLayout::Strided { .. }
    ))
}

/// The value of an unlabelled-by-reason sample of the decode node's `/metrics`.
async fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    let text = metrics::scrape(&addr.to_string()).await.expect("/metrics");
    metrics::value(&text, name, &[]).unwrap_or_else(|| panic!("{name} not in /metrics"))
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs an RDMA device named by PD_TEST_RDMA_DEVICE: scripts/rdma-check.sh runs it"]
async fn kv_moves_over_rdma_and_decodes_as_over_tcp() {
    let dev = device();
    let tokens: Vec<u32> = (0..100u32).map(|i| (i * 7919 + 11) % 150_000).collect();
    let (purl, durl, metrics, stops) =
        pair(&["--kv-transport", "rdma", "--rdma-device", &dev]).await;
    let (over_rdma, offered) = generate(&purl, &durl, &tokens).await;
    // A CPU node registers its KV memory and offers leases where they lie; that needs
    // memlock room for all of it.
    assert_eq!(
        offered,
        Some(true),
        "the prefill node offered the lease over RDMA, in place (if staged: raise `ulimit -l`)"
    );
    assert_eq!(
        metric(metrics, "pd_node_kv_transfer_failovers_total").await,
        0.0,
        "the read went over RDMA without failing over"
    );
    assert!(metric(metrics, "pd_node_kv_transfer_bytes_total").await > 0.0);
    drop(stops);
    let (purl, durl, _, stops) = pair(&["--kv-transport", "tcp"]).await;
    let (over_tcp, offered) = generate(&purl, &durl, &tokens).await;
    assert_eq!(offered, None);
    assert_eq!(over_rdma, over_tcp);
    drop(stops);
    tokio::time::sleep(Duration::from_millis(100)).await;
}
