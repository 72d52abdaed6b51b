//! Failure isolation in the generate flow: an engine panic (a node's INTERNAL marked as one)
//! reaches the client as INTERNAL and is never retried on another node; nodes that keep
//! failing are skipped by their circuit breakers, which show on `/metrics` and close again
//! after a successful probe.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use pd_router::registry::BreakerConfig;
use pd_test_support::metrics::value;
use tonic::Code;

use super::{all_up, two_prefills_in_turn};
use crate::fake::*;

#[tokio::test]
async fn an_engine_panic_on_a_prefill_node_is_internal_and_not_retried() {
    let (p0, p1, d, router) = two_prefills_in_turn(|_| {}).await;
    for p in [&p0, &p1] {
        p.state.fail_as_panic.store(true, SeqCst);
        p.state.fail_next.store(1, SeqCst);
    }
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("poison")).await.unwrap();
    assert!(chunks.is_empty());
    let status = error.expect("the request fails");
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(status.message().contains("engine panic"), "{status:?}");
    // One node saw it; the other was never tried.
    assert_eq!(p0.state.prefill_count() + p1.state.prefill_count(), 1);
    assert_eq!(d.state.decode_count(), 0);
    let text = router.metrics_text().await;
    assert_eq!(
        value(&text, "pd_router_retries_total", &["role=\"prefill\""]),
        Some(0.0)
    );
}

#[tokio::test]
async fn an_engine_panic_on_a_decode_node_is_internal_and_not_retried() {
    let p = FakeNode::prefill().await;
    let d0 = FakeNode::decode().await;
    let d1 = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d0, &d1])).await;
    all_up(&router).await;
    for d in [&d0, &d1] {
        d.state.fail_as_panic.store(true, SeqCst);
        d.state.fail_next.store(1, SeqCst);
    }
    let mut client = router.client();
    let (_, error) = collect(&mut client, text_request("poison")).await.unwrap();
    let status = error.expect("the request fails");
    // The client had the prefill node's token: still INTERNAL, not "try again" UNAVAILABLE.
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert_eq!(d0.state.decode_count() + d1.state.decode_count(), 1);
}

#[tokio::test]
async fn a_failing_node_s_breaker_opens_and_requests_skip_it() {
    let (p0, p1, _d, router) = two_prefills_in_turn(|cfg| {
        cfg.breaker = BreakerConfig {
            failures: 2,
            // Longer than the test: once open, it stays open.
            cooldown: Duration::from_secs(600),
        }
    })
    .await;
    // p0 answers every request INTERNAL (its Info stays healthy): each failure is retried on
    // p1, until p0's breaker opens after its second.
    *p0.state.fail_code.lock().unwrap() = Code::Internal;
    p0.state.fail_next.store(usize::MAX, SeqCst);
    let mut client = router.client();
    let mut requests = 0;
    while p0.state.prefill_count() < 2 {
        requests += 1;
        assert!(requests < 50, "p0 never got two requests");
        let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
        assert!(error.is_none(), "{error:?}");
    }
    for _ in 0..6 {
        let (_, error) = collect(&mut client, text_request("y")).await.unwrap();
        assert!(error.is_none(), "{error:?}");
    }
    assert_eq!(
        p0.state.prefill_count(),
        2,
        "an open breaker's node got requests"
    );
    let text = router.metrics_text().await;
    let p0_addr = format!("node=\"{}\"", p0.address());
    let p1_addr = format!("node=\"{}\"", p1.address());
    assert_eq!(
        value(&text, "pd_router_node_circuit_state", &[&p0_addr]),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "pd_router_node_circuit_state", &[&p1_addr]),
        Some(0.0)
    );
    assert_eq!(
        value(
            &text,
            "pd_router_node_circuit_transitions_total",
            &[&p0_addr, "state=\"open\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(&text, "pd_router_retries_total", &["role=\"prefill\""]),
        Some(2.0)
    );
}

#[tokio::test]
async fn after_its_cooldown_a_successful_probe_closes_the_breaker() {
    let (p0, _p1, _d, router) = two_prefills_in_turn(|cfg| {
        cfg.breaker = BreakerConfig {
            failures: 1,
            cooldown: Duration::from_millis(100),
        }
    })
    .await;
    *p0.state.fail_code.lock().unwrap() = Code::Internal;
    p0.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let p0_addr = format!("node=\"{}\"", p0.address());
    let transitions = |text: &str, state: &str| {
        let state = format!("state=\"{state}\"");
        value(
            text,
            "pd_router_node_circuit_transitions_total",
            &[&p0_addr, &state],
        )
        .unwrap_or(0.0)
    };
    // Requests go on (p0's failure retried on p1) until p0's breaker has opened, been
    // probed after its cool-down, and closed: p0 no longer fails.
    let mut requests = 0;
    loop {
        let (_, error) = collect(&mut client, text_request("z")).await.unwrap();
        assert!(error.is_none(), "{error:?}");
        let text = router.metrics_text().await;
        if transitions(&text, "closed") >= 1.0 {
            assert_eq!(transitions(&text, "open"), 1.0);
            assert_eq!(transitions(&text, "half_open"), 1.0);
            assert_eq!(
                value(&text, "pd_router_node_circuit_state", &[&p0_addr]),
                Some(0.0)
            );
            break;
        }
        requests += 1;
        assert!(requests < 500, "the breaker never closed: {text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
