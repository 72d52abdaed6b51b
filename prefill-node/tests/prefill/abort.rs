//! Ending requests early on an in-process node: abort by id, duplicate ids, calls the client
//! cancels, and shutdown (drain, refusing new work, waiting for leases, the drain timeout).

use std::time::{Duration, Instant};

use pd_proto::pb;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::{Node, channel, prefill_node, prefill_request, prompt};

/// Wait until the node runs or queues a request.
async fn wait_busy(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = node.info().await;
        if info.num_running + info.num_waiting > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_duplicate_ids_and_cancelled_calls_free_every_block() {
    // Small steps make a long prompt's prefill take hundreds of steps.
    let node = prefill_node(&["--max-num-batched-tokens", "4"]).await;
    let slow = prompt(3000, 4);

    // Abort by id; the id is in use meanwhile.
    let mut client = node.prefill().await;
    let call = tokio::spawn({
        let mut client = node.prefill().await;
        let slow = slow.clone();
        async move { client.prefill(prefill_request("slow", slow)).await }
    });
    wait_busy(&node).await;
    let dup = client
        .prefill(prefill_request("slow", prompt(4, 0)))
        .await
        .expect_err("duplicate id");
    assert_eq!(dup.code(), Code::InvalidArgument);
    assert!(dup.message().contains("already in use"), "{dup:?}");
    let aborted = client
        .abort(pb::NodeAbortRequest {
            request_id: "slow".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(aborted.aborted);
    let e = call.await.unwrap().expect_err("aborted call");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    node.assert_all_blocks_free().await;

    // A call the client gives up on aborts the engine request.
    let mut impatient = node.prefill().await;
    // Well under the prefill's time: its 750 steps of 4 tokens took about 300 ms on AVX-512.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(40),
        impatient.prefill(prefill_request("impatient", slow)),
    )
    .await;
    assert!(gave_up.is_err(), "the slow prefill should still be running");
    // The same id again: the node takes it once the cancelled call is gone, and the engine
    // only if that request was aborted (it refuses an id still open; its abort and this
    // submission reach it in order).
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match client
            .prefill(prefill_request("impatient", prompt(4, 0)))
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(e) if e.message().contains("on this node") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => panic!("the cancelled prefill was not aborted: {e:?}"),
        }
    };
    client
        .release_kv(crate::release_of(again.kv.as_ref().unwrap()))
        .await
        .unwrap();
    node.assert_all_blocks_free().await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_refuses_new_work_and_waits_for_leases() {
    let node = prefill_node(&["--max-num-batched-tokens", "4", "--drain-timeout", "20"]).await;
    let mut client = node.prefill().await;
    let mut health = HealthClient::new(channel(node.ready.grpc).await);
    let call = tokio::spawn({
        let mut client = node.prefill().await;
        async move {
            client
                .prefill(prefill_request("in-flight", prompt(600, 5)))
                .await
        }
    });
    wait_busy(&node).await;
    let (ready, task) = node.begin_shutdown();
    // Draining: NOT_SERVING, new work refused, other calls still answered.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = health
            .check(HealthCheckRequest {
                service: "pd.v1.PrefillService".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        if status == ServingStatus::NotServing as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "health never turned NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let refused = client
        .prefill(prefill_request("late", prompt(4, 0)))
        .await
        .expect_err("draining");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        !client
            .info(pb::InfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .healthy
    );
    // The in-flight prefill finishes; the node waits for its lease.
    let r = call
        .await
        .unwrap()
        .expect("in-flight prefill finishes")
        .into_inner();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !task.is_finished(),
        "the drain waits for the lease to be released"
    );
    let released = client
        .release_kv(crate::release_of(r.kv.as_ref().unwrap()))
        .await
        .unwrap()
        .into_inner();
    assert!(released.released);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops once drained")
        .unwrap()
        .expect("clean stop");
    assert!(
        tokio::net::TcpStream::connect(ready.grpc).await.is_err(),
        "the gRPC port is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_aborts_what_is_left() {
    let node = prefill_node(&["--max-num-batched-tokens", "2", "--drain-timeout", "0.2"]).await;
    let call = tokio::spawn({
        let mut client = node.prefill().await;
        async move {
            client
                .prefill(prefill_request("too-slow", prompt(4000, 6)))
                .await
        }
    });
    wait_busy(&node).await;
    let started = Instant::now();
    node.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(10));
    let e = call.await.unwrap().expect_err("aborted by the drain");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
}
