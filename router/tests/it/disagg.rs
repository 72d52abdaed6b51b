//! `--disagg` against fake nodes: which node computes each prompt under each setting, the
//! decision counters, and `auto` computing on the decode node when no prefill node is up.

use pd_router::disagg::DisaggMode;
use pd_test_support::metrics::sum;

use crate::fake::*;

const DECISIONS: &str = "pd_router_disagg_decisions_total";

async fn decisions(router: &RouterUnderTest, path: &str, reason: &str) -> f64 {
    let text = router.metrics_text().await;
    sum(
        &text,
        DECISIONS,
        &[&format!("path=\"{path}\""), &format!("reason=\"{reason}\"")],
    )
}

async fn serve(router: &RouterUnderTest, n: usize) {
    let mut client = router.client();
    for i in 0..n {
        let (chunks, error) = collect(&mut client, text_request(&format!("request {i}")))
            .await
            .unwrap();
        assert!(error.is_none(), "{error:?}");
        assert!(!all_text(&chunks).is_empty());
    }
}

#[tokio::test]
async fn always_prefills_remotely_and_never_on_the_decode_node() {
    for (mode, prefills, path) in [
        (DisaggMode::Always, 3, "remote"),
        (DisaggMode::Never, 0, "local"),
    ] {
        let p = FakeNode::prefill().await;
        let d = FakeNode::decode().await;
        let mut cfg = config(&[&p], &[&d]);
        cfg.disagg = mode;
        let router = RouterUnderTest::start(cfg).await;
        serve(&router, 3).await;
        assert_eq!(p.state.prefill_count(), prefills, "{mode:?}");
        assert_eq!(d.state.decode_count(), 3, "{mode:?}");
        assert_eq!(decisions(&router, path, "setting").await, 3.0, "{mode:?}");
    }
}

#[tokio::test]
async fn auto_starts_remote_and_computes_locally_without_a_prefill_node() {
    let mut p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.disagg = DisaggMode::Auto;
    let router = RouterUnderTest::start(cfg).await;
    // The series auto can raise exist before any request.
    let text = router.metrics_text().await;
    for reason in ["estimated_cost", "no_prefill_node"] {
        let series = text.lines().any(|l| {
            l.starts_with(DECISIONS)
                && l.contains("path=\"local\"")
                && l.contains(&format!("reason=\"{reason}\""))
                && l.ends_with(" 0")
        });
        assert!(series, "{text}");
    }
    // Nothing measured: the first request goes the remote way.
    serve(&router, 1).await;
    assert_eq!(p.state.prefill_count(), 1);
    assert_eq!(decisions(&router, "remote", "unmeasured").await, 1.0);

    // The prefill node goes away: the decode node computes the prompts itself.
    p.stop().await;
    let node = router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == p.address())
        .expect("registered")
        .clone();
    eventually("the prefill node marked down", || !node.is_up()).await;
    let decoded = d.state.decode_count();
    serve(&router, 2).await;
    assert_eq!(d.state.decode_count(), decoded + 2);
    assert_eq!(decisions(&router, "local", "no_prefill_node").await, 2.0);
}
