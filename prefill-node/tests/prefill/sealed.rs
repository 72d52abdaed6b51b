//! Sealed leases as an outsider sees them: lease ids that do not count up, a raw pull on the
//! KV export port naming ids around a real lease (with the right fingerprint) or the real id
//! with a wrong secret gets no byte of KV and nothing about the node's layout, and a release
//! with a wrong secret releases nothing.

use std::net::SocketAddr;

use pd_engine::serve::LeaseSecret;
use pd_proto::pb;
use pd_transport::LayoutFingerprint;
use pd_transport::wire::{
    FRAME_HEADER_LEN, FrameHeader, FrameKind, PULL_RESPONSE_BODY_LEN, PullRequestFrame,
    PullResponseFrame, Status,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::{prefill_node, prefill_request, prompt, release_of};

/// Every byte the export server sends back to one raw pull request (it is read until the
/// server has answered and the socket is closed from our side).
async fn raw_pull(addr: SocketAddr, frame: PullRequestFrame) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&frame.encode()).await.unwrap();
    // Half-close: the server answers, then sees the end of our requests and closes.
    s.shutdown().await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        s.read_to_end(&mut reply),
    )
    .await
    .expect("the server answers and closes")
    .unwrap();
    reply
}

fn response(reply: &[u8]) -> PullResponseFrame {
    let header = FrameHeader::decode(reply[..FRAME_HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(header.kind, FrameKind::PullResponse as u16);
    let body = &reply[FRAME_HEADER_LEN..FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN];
    let (mut resp, msg_len) = PullResponseFrame::decode_body(body.try_into().unwrap()).unwrap();
    let at = FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN;
    resp.message = String::from_utf8_lossy(&reply[at..at + msg_len]).into_owned();
    resp
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_pulls_without_the_lease_secret_get_no_kv_and_no_layout() {
    let node = prefill_node(&[]).await;
    let mut client = node.prefill().await;
    let kv_addr = node.ready.kv.expect("a KV address");
    let fingerprint: LayoutFingerprint = node.ready.fingerprint.parse().unwrap();

    let mut handles = Vec::new();
    for i in 0..3 {
        let r = client
            .prefill(prefill_request(&format!("sealed-{i}"), prompt(40, 30 + i)))
            .await
            .expect("prefill")
            .into_inner();
        handles.push(r.kv.expect("a lease"));
    }
    let ids: Vec<u64> = handles.iter().map(|kv| kv.lease_id).collect();
    assert!(ids.iter().all(|&id| id != 0), "{ids:?}");
    assert!(
        ids.windows(2).all(|w| w[1].abs_diff(w[0]) > 1 << 20),
        "lease ids do not count up: {ids:?}"
    );
    assert!(handles.iter().all(|kv| kv.lease_secret.len() == 16));
    assert_ne!(handles[0].lease_secret, handles[1].lease_secret);

    let kv = &handles[1];
    let secret = LeaseSecret::from_slice(&kv.lease_secret).unwrap();
    let good = PullRequestFrame {
        lease_id: kv.lease_id,
        lease_secret: secret,
        fingerprint,
        first_block: 0,
        count: u64::from(kv.num_blocks),
        block_bytes: kv.block_bytes,
        timeout_ms: 5_000,
    };
    // The real id with its secret: the KV comes (so the refusals below are not a broken
    // request).
    let reply = raw_pull(kv_addr, good).await;
    assert_eq!(response(&reply).status, Status::Ok);
    let payload = reply.len() - FRAME_HEADER_LEN - PULL_RESPONSE_BODY_LEN;
    assert!(payload as u64 >= u64::from(kv.num_blocks) * kv.block_bytes);

    let mut wrong = *secret.as_bytes();
    wrong[7] ^= 0x10;
    let mut attempts: Vec<PullRequestFrame> = [1u64, 2, 3, 1 << 32]
        .iter()
        .flat_map(|&d| [kv.lease_id.wrapping_add(d), kv.lease_id.wrapping_sub(d)])
        .chain([1, 2, 3])
        .map(|lease_id| PullRequestFrame { lease_id, ..good })
        .collect();
    attempts.push(PullRequestFrame {
        lease_secret: LeaseSecret::from_bytes(wrong),
        ..good
    });
    attempts.push(PullRequestFrame {
        lease_secret: LeaseSecret::from_bytes([0; 16]),
        ..good
    });
    // Another lease's secret with this id.
    attempts.push(PullRequestFrame {
        lease_secret: LeaseSecret::from_slice(&handles[0].lease_secret).unwrap(),
        ..good
    });
    let mut refusals = Vec::new();
    for frame in attempts {
        let reply = raw_pull(kv_addr, frame).await;
        let resp = response(&reply);
        assert_eq!(resp.status, Status::UnknownLease, "{frame:?}");
        assert_eq!(
            reply.len(),
            FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN + resp.message.len(),
            "a refusal and nothing after it: no byte of KV"
        );
        assert_eq!(
            (
                resp.fingerprint,
                resp.block_bytes,
                resp.count,
                resp.chunk_bytes
            ),
            (LayoutFingerprint(0), 0, 0, 0),
            "no layout in the refusal"
        );
        assert!(
            !contains(&reply, &fingerprint.0.to_le_bytes())
                && !contains(&reply, &kv.block_bytes.to_le_bytes())
                && !contains(&reply, node.ready.fingerprint.as_bytes())
                && !contains(&reply, kv.block_bytes.to_string().as_bytes()),
            "neither the fingerprint nor the block size anywhere in {reply:02x?}"
        );
        refusals.push(resp);
    }
    assert!(
        refusals.windows(2).all(|w| w[0] == w[1]),
        "one refusal for all: {refusals:?}"
    );

    for kv in &handles {
        let released = client
            .release_kv(release_of(kv))
            .await
            .unwrap()
            .into_inner();
        assert!(released.released);
    }
    node.assert_all_blocks_free().await;
    let export_refusals = node.info().await.counters.unwrap().kv_transfer_failures;
    assert!(
        export_refusals.get("lease_gone").copied().unwrap_or(0) >= refusals.len() as u64,
        "refused pulls are counted as lease_gone: {export_refusals:?}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_with_a_wrong_secret_leaves_the_blocks_leased() {
    let node = prefill_node(&[]).await;
    let mut client = node.prefill().await;
    let r = client
        .prefill(prefill_request("held", prompt(40, 40)))
        .await
        .expect("prefill")
        .into_inner();
    let kv = r.kv.expect("a lease");
    let held = node.info().await.free_blocks;
    let mut wrong = release_of(&kv);
    wrong.lease_secret[15] ^= 1;
    let answer = client.release_kv(wrong).await.unwrap().into_inner();
    assert!(!answer.released, "a wrong secret releases nothing");
    let mut short = release_of(&kv);
    short.lease_secret.pop();
    let e = client.release_kv(short).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(
        node.info().await.free_blocks,
        held,
        "the blocks stay leased"
    );
    let answer = client
        .release_kv(release_of(&kv))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.released, "the right secret releases the lease");
    let _: pb::ReleaseKvResponse = answer;
    node.assert_all_blocks_free().await;
    node.shutdown().await;
}
