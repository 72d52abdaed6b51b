//! The soak's clients: each sends one request after another to the router until told to
//! stop — prompts that share a few prefixes and prompts that share nothing, one or several
//! choices, greedy and sampled, some aborted through the `Abort` RPC, some dropped mid-stream
//! (a client disconnect), some with a deadline too short to finish — and judges how each one
//! ended.
//!
//! Not here: what happens to the cluster meanwhile (`super::chaos`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::time::Instant;
use tonic::Code;

/// The deadline every request carries (`grpc-timeout`), unless it asks for a short one.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// How late past its deadline a request may end before the soak calls it a hang: the
/// client's own timer, the router's and one scheduling hiccup of a loaded 2-core machine.
pub const GRACE: Duration = Duration::from_secs(5);
/// Longest prompt sent, in tokens (bounds what one lost report can hold).
pub const MAX_PROMPT: u32 = 160;
/// Most tokens one request generates over all its choices.
pub const MAX_GENERATED: u32 = 3 * 48;

/// What a client did with its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Read the stream to its end.
    Read,
    /// Call `Abort` after the first chunk and read on.
    Abort,
    /// Drop the stream after a few chunks.
    Disconnect,
    /// A deadline of a fraction of a second.
    ShortDeadline,
}

/// How a request ended, as the soak judges it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Every choice ended with a finish reason and its tokens.
    Completed,
    /// The client aborted it and the stream said so.
    Aborted,
    /// The client dropped it.
    Disconnected,
    /// A clear error: the gRPC code and the message.
    Refused(String, String),
    /// Not acceptable: what was wrong.
    Violation(String),
}

/// Shared between the clients and the driver.
pub struct LoadState {
    pub stop: AtomicBool,
    /// While the router is down or restarting: transport errors are expected then.
    pub router_down: AtomicBool,
}

/// One finished request.
#[derive(Debug, Clone)]
pub struct Record {
    pub action: Action,
    pub outcome: Outcome,
    /// How long past its deadline it ended (zero if on time).
    pub late: Duration,
}

/// The shared prefixes (block-aligned lengths: the prefix cache reuses whole blocks).
fn prefixes(seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    [32u32, 64, 96, 128]
        .iter()
        .map(|&len| (0..len).map(|_| rng.random_range(0..150_000)).collect())
        .collect()
}

/// One random request and what to do with it.
fn request(rng: &mut ChaCha8Rng, prefixes: &[Vec<u32>], id: &str) -> (pb::GenerateRequest, Action) {
    let mut ids: Vec<u32> = if rng.random_bool(0.7) {
        prefixes[rng.random_range(0..prefixes.len())].clone()
    } else {
        Vec::new()
    };
    let own = rng
        .random_range(1..=MAX_PROMPT - ids.len() as u32)
        .min(32 + rng.random_range(0..32));
    ids.extend((0..own).map(|_| rng.random_range(0..150_000u32)));
    let n = if rng.random_bool(0.2) {
        rng.random_range(2..=3)
    } else {
        1
    };
    let sampling = match rng.random_range(0..10) {
        0..5 => pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        },
        5..8 => pb::SamplingParams {
            temperature: Some(0.8),
            seed: Some(rng.random()),
            ..Default::default()
        },
        _ => pb::SamplingParams {
            temperature: Some(1.0),
            top_p: Some(0.9),
            ..Default::default()
        },
    };
    let action = match rng.random_range(0..20) {
        0..14 => Action::Read,
        14..16 => Action::Abort,
        16..19 => Action::Disconnect,
        _ => Action::ShortDeadline,
    };
    let request = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds { ids })),
        sampling: Some(sampling),
        max_tokens: Some(rng.random_range(1..=MAX_GENERATED / 3)),
        ignore_eos: rng.random_bool(0.8),
        n: (n > 1).then_some(n),
        request_id: Some(id.to_string()),
        ..Default::default()
    };
    (request, action)
}

fn with_key<T>(message: T, key: &str, deadline: Duration) -> tonic::Request<T> {
    let mut request = crate::with_key(message, Some(key));
    request.set_timeout(deadline);
    request
}

/// Runs one client until `state.stop`; returns its records.
pub async fn client(
    n: usize,
    seed: u64,
    mut grpc: GenerationClient<tonic::transport::Channel>,
    key: String,
    state: Arc<LoadState>,
) -> Vec<Record> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(n as u64 * 7919));
    let prefixes = prefixes(seed);
    let mut records = Vec::new();
    let mut i = 0u64;
    while !state.stop.load(Ordering::Relaxed) {
        i += 1;
        let id = format!("soak-{n}-{i}");
        let (req, action) = request(&mut rng, &prefixes, &id);
        let deadline = match action {
            Action::ShortDeadline => Duration::from_millis(rng.random_range(20..400)),
            _ => DEADLINE,
        };
        let started = Instant::now();
        let outcome = one(&mut grpc, req, action, deadline, &key, &id).await;
        let took = started.elapsed();
        let outcome = match outcome {
            // A broken connection is what a client sees while the router itself is down.
            Outcome::Violation(v)
                if state.router_down.load(Ordering::Relaxed) && v.starts_with("transport") =>
            {
                Outcome::Refused("transport (router down)".into(), v)
            }
            o => o,
        };
        let late = took.saturating_sub(deadline);
        records.push(Record {
            action,
            outcome: if late > GRACE {
                Outcome::Violation(format!("ended {late:?} past its deadline"))
            } else {
                outcome
            },
            late,
        });
        if matches!(
            records.last().map(|r| &r.outcome),
            Some(Outcome::Refused(..))
        ) {
            // Do not spin on a refusing cluster.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    records
}

async fn one(
    grpc: &mut GenerationClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
    action: Action,
    deadline: Duration,
    key: &str,
    id: &str,
) -> Outcome {
    let choices = req.n.unwrap_or(1);
    let max_tokens = req.max_tokens.unwrap_or(0) as usize;
    let mut stream = match grpc.generate(with_key(req, key, deadline)).await {
        Ok(s) => s.into_inner(),
        Err(status) => return judge_error(&status),
    };
    let mut tokens: BTreeMap<u32, usize> = BTreeMap::new();
    let mut finished: BTreeMap<u32, i32> = BTreeMap::new();
    let mut usage: BTreeMap<u32, u32> = BTreeMap::new();
    let mut chunks = 0;
    let mut aborted = false;
    loop {
        let chunk = match stream.message().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(status) => {
                return if aborted && matches!(status.code(), Code::Cancelled | Code::Aborted) {
                    Outcome::Aborted
                } else {
                    judge_error(&status)
                };
            }
        };
        chunks += 1;
        *tokens.entry(chunk.index).or_default() += chunk.token_ids.len();
        if chunk.finish_reason != pb::FinishReason::Unspecified as i32 {
            finished.insert(chunk.index, chunk.finish_reason);
        }
        if let Some(u) = &chunk.usage {
            usage.insert(chunk.index, u.completion_tokens);
        }
        match action {
            Action::Abort if !aborted => {
                aborted = true;
                let abort = pb::AbortRequest {
                    request_id: id.to_string(),
                };
                if let Err(status) = grpc.abort(with_key(abort, key, DEADLINE)).await {
                    return Outcome::Violation(format!(
                        "Abort answered {:?}: {}",
                        status.code(),
                        status.message()
                    ));
                }
            }
            Action::Disconnect if chunks >= 2 => return Outcome::Disconnected,
            _ => {}
        }
    }
    for index in 0..choices {
        let Some(&reason) = finished.get(&index) else {
            return Outcome::Violation(format!(
                "stream ended without a finish reason for choice {index}"
            ));
        };
        let got = tokens.get(&index).copied().unwrap_or(0);
        if got > max_tokens {
            return Outcome::Violation(format!("choice {index}: {got} tokens > max_tokens"));
        }
        if reason == pb::FinishReason::Length as i32 && got != max_tokens {
            return Outcome::Violation(format!(
                "choice {index}: finish LENGTH after {got} of {max_tokens} tokens"
            ));
        }
        if reason == pb::FinishReason::Abort as i32 && !aborted {
            return Outcome::Violation(format!("choice {index} aborted unasked"));
        }
        // Each choice's usage is its own.
        match usage.get(&index) {
            Some(&u) if u as usize == got => {}
            Some(u) => {
                return Outcome::Violation(format!(
                    "choice {index}: usage says {u} completion tokens, the stream carried {got}"
                ));
            }
            None => return Outcome::Violation(format!("choice {index}: no usage")),
        }
    }
    if aborted {
        Outcome::Aborted
    } else {
        Outcome::Completed
    }
}

/// A gRPC error is clear when its code says what happened and it has a message; a broken
/// connection (Unknown / transport) is judged by the caller (only expected while the router
/// is down).
fn judge_error(status: &tonic::Status) -> Outcome {
    let code = status.code();
    let message = status.message();
    match code {
        Code::Unavailable
        | Code::ResourceExhausted
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Aborted
        | Code::Internal
            if !message.is_empty() =>
        {
            Outcome::Refused(format!("{code:?}"), message.to_string())
        }
        Code::Unknown | Code::Unavailable => Outcome::Violation(format!("transport: {message}")),
        _ => Outcome::Violation(format!("{code:?}: {message}")),
    }
}
