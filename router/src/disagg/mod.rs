//! Whether a request's prompt is computed on a prefill node and its KV moved to the decode
//! node (the **remote** path), or computed by the decode node itself (the **local** path):
//! `--disagg always|never|auto`.
//!
//! With `auto`, each request's two paths are priced in seconds to its second token, from what
//! the router measured of its nodes ([`Costs`]), and the cheaper one is taken:
//!
//! - remote = the prefill node's time to compute the tokens its cache lacks (after the work
//!   the router has queued on it) + the time from `Decode` to the decode node's first message
//!   when it pulls the blocks it lacks from that prefill node (transfer, import and one step)
//!   + the delay that computation and that pull put on the decode node's running streams;
//! - local = the decode node's time to compute the tokens its own cache lacks (after the
//!   prompts queued on it) + one decode step + the delay that computation puts on its running
//!   streams.
//!
//! A delay on the streams is seconds of work × streams the router has on the decode node ×
//! the fraction by which such work was measured to slow that node's steps: its step time while
//! it computed a prompt itself, while it pulled KV, or while only other nodes computed or
//! pulled, against its step time while nothing was in flight. Until measured, a prompt
//! computed on the decode node stalls its streams (fraction 1, as on a GPU), and a prompt
//! computed elsewhere or a pull does not (0: separate hardware, a DMA engine); on hardware the
//! nodes share, all of it is learnt as it happens.
//!
//! Both paths are priced towards one decode node: the one the prompt-computing policy
//! chooses (as `never` places a request), so that they differ only in where the prompt is
//! computed. A decode node that has never computed a prompt is priced at the prefill nodes'
//! rate (the same engine). Before any prefill was measured the remote path is taken
//! (`unmeasured`); without a prefill node to use, `auto` computes locally rather than fail.
//!
//! Not here: carrying out either path (`crate::flow`), counting the decisions
//! ([`crate::metrics`]).

mod costs;
mod fit;

pub use costs::{Busy, Costs, InFlight};

use clap::ValueEnum;

/// `--disagg`: where prompts are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DisaggMode {
    /// Always on a prefill node, the KV then moved to the decode node.
    Always,
    /// Always on the decode node itself (prefill nodes stay unused).
    Never,
    /// Per request, whichever path the router's measurements say is faster.
    Auto,
}

impl DisaggMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DisaggMode::Always => "always",
            DisaggMode::Never => "never",
            DisaggMode::Auto => "auto",
        }
    }
}

/// Where one request's prompt is computed (the `path` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// On a prefill node; the decode node pulls the KV.
    Remote,
    /// On the decode node.
    Local,
}

impl Path {
    pub const ALL: [Path; 2] = [Path::Remote, Path::Local];

    pub fn as_str(self) -> &'static str {
        match self {
            Path::Remote => "remote",
            Path::Local => "local",
        }
    }
}

/// Why the path was taken (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `--disagg always` or `never`.
    Setting,
    /// `auto`: this path's estimate was the lower.
    EstimatedCost,
    /// `auto`: no prefill node could take the request.
    NoPrefillNode,
    /// `auto`: no decode node to price the local path on (the request fails, or ends with
    /// its first token, on the remote path).
    NoDecodeNode,
    /// `auto`: nothing measured yet to price the paths with.
    Unmeasured,
}

impl Reason {
    pub const ALL: [Reason; 5] = [
        Reason::Setting,
        Reason::EstimatedCost,
        Reason::NoPrefillNode,
        Reason::NoDecodeNode,
        Reason::Unmeasured,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Setting => "setting",
            Reason::EstimatedCost => "estimated_cost",
            Reason::NoPrefillNode => "no_prefill_node",
            Reason::NoDecodeNode => "no_decode_node",
            Reason::Unmeasured => "unmeasured",
        }
    }
}

/// The remote path as the policies chose it.
#[derive(Debug, Clone, Copy)]
pub struct RemoteOption {
    pub prefill: usize,
    pub decode: usize,
    /// Prompt tokens the prefill node holds (device and host tiers).
    pub prefill_hits: u64,
    /// Blocks of the prompt the decode node lacks and would pull.
    pub pulled_blocks: u64,
    /// Whether a decode node continues at all (false: the first token ends the request).
    pub moves_kv: bool,
    /// Streams the router has on the decode node.
    pub streams: u64,
}

/// The local path on one decode node.
#[derive(Debug, Clone, Copy)]
pub struct LocalOption {
    pub decode: usize,
    /// Prompt tokens the decode node holds (device and host tiers).
    pub hits: u64,
    /// Streams the router has on the node (they wait for a local prefill).
    pub streams: u64,
}

/// One request's decision and the estimates behind it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub path: Path,
    pub reason: Reason,
    /// The decode node of the local path (its index in the local options).
    pub local: Option<usize>,
    pub remote_seconds: Option<f64>,
    pub local_seconds: Option<f64>,
}

impl Decision {
    pub fn fixed(path: Path, reason: Reason) -> Self {
        Self {
            path,
            reason,
            local: None,
            remote_seconds: None,
            local_seconds: None,
        }
    }
}

/// The `--disagg` setting and what it decides with.
#[derive(Debug)]
pub struct Disagg {
    pub mode: DisaggMode,
    pub costs: Costs,
}

impl Disagg {
    pub fn new(mode: DisaggMode) -> Self {
        Self {
            mode,
            costs: Costs::default(),
        }
    }

    /// Whether requests are measured: only `auto` uses the measurements.
    pub fn measuring(&self) -> bool {
        self.mode == DisaggMode::Auto
    }

    /// Seconds to the second token on the remote path; `None` while unmeasured.
    pub fn remote_seconds(&self, prompt: u64, o: &RemoteOption) -> Option<f64> {
        let compute = prompt.saturating_sub(o.prefill_hits).max(1);
        let prefill = self.costs.prefill(Path::Remote, o.prefill, compute)?;
        let transfer = match o.moves_kv {
            true => self.costs.transfer(o.prefill, o.decode, o.pulled_blocks),
            false => 0.0,
        };
        let slowdown = |busy| self.costs.slowdown(o.decode, busy).unwrap_or(0.0);
        // The streams wait for what the prompt's compute elsewhere and the pull into their
        // node take from them (both nothing until measured: separate hardware).
        let stalled = self.costs.compute(Path::Remote, o.prefill, compute)
            * slowdown(Busy::Elsewhere)
            + transfer * slowdown(Busy::Pulling);
        Some(prefill + transfer + stalled * o.streams as f64)
    }

    /// Seconds to the second token on the local path, plus the delay it puts on the node's
    /// running streams; `None` while unmeasured.
    pub fn local_seconds(&self, prompt: u64, o: &LocalOption) -> Option<f64> {
        let compute = prompt.saturating_sub(o.hits).max(1);
        let own = self.costs.prefill(Path::Local, o.decode, compute)? + self.costs.step(o.decode);
        let slowdown = self.costs.slowdown(o.decode, Busy::Here).unwrap_or(1.0);
        let delay =
            self.costs.compute(Path::Local, o.decode, compute) * o.streams as f64 * slowdown;
        Some(own + delay)
    }

    /// `auto`'s choice between `remote` and the cheapest of `locals` (never empty).
    pub fn decide(&self, prompt: u64, remote: &RemoteOption, locals: &[LocalOption]) -> Decision {
        let remote_seconds = self.remote_seconds(prompt, remote);
        let best_local = locals
            .iter()
            .enumerate()
            .filter_map(|(i, o)| self.local_seconds(prompt, o).map(|s| (i, s)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        choose(remote_seconds, best_local)
    }
}

/// The cheaper path; ties and missing estimates keep the remote path (the disaggregated
/// cluster's own way).
fn choose(remote: Option<f64>, local: Option<(usize, f64)>) -> Decision {
    match (remote, local) {
        (Some(r), Some((i, l))) => Decision {
            path: if l < r { Path::Local } else { Path::Remote },
            reason: Reason::EstimatedCost,
            local: Some(i),
            remote_seconds: Some(r),
            local_seconds: Some(l),
        },
        _ => Decision::fixed(Path::Remote, Reason::Unmeasured),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured() -> Disagg {
        let d = Disagg::new(DisaggMode::Auto);
        // Prefill node 0: 1 ms fixed + 0.1 ms per token; decode nodes 10 and 11 alike.
        for tokens in [16u64, 64, 256, 1024] {
            let s = 0.001 + 0.0001 * tokens as f64;
            d.costs.prefilled(0, tokens, s);
            d.costs.computed_locally(10, tokens, s);
            d.costs.computed_locally(11, tokens, s);
        }
        // Transfers: 2 ms fixed + 1 ms per 1000 bytes; blocks of 1000 bytes.
        d.costs.saw_block_bytes(0, 1000);
        for blocks in [1u64, 8, 32] {
            d.costs
                .transferred(0, 10, blocks * 1000, 0.002 + 0.001 * blocks as f64);
        }
        d
    }

    fn remote(prefill_hits: u64, pulled_blocks: u64) -> RemoteOption {
        RemoteOption {
            prefill: 0,
            decode: 10,
            prefill_hits,
            pulled_blocks,
            moves_kv: true,
            streams: 0,
        }
    }

    /// Decode node 10 stepped in `quiet` seconds alone and in `here` while computing a prompt.
    fn quiet_and_busy_steps(d: &Disagg, quiet: f64, here: f64) {
        d.costs.stepped(10, quiet);
        let _computing = d.costs.queue(10, 1);
        d.costs.stepped(10, here);
    }

    #[test]
    fn nothing_measured_keeps_the_remote_path() {
        let d = Disagg::new(DisaggMode::Auto);
        let local = LocalOption {
            decode: 10,
            hits: 1000,
            streams: 0,
        };
        let decision = d.decide(1024, &remote(0, 64), &[local]);
        assert_eq!(
            (decision.path, decision.reason),
            (Path::Remote, Reason::Unmeasured)
        );
    }

    #[test]
    fn a_decode_node_holding_the_conversation_computes_it_itself() {
        let d = measured();
        // The decode node holds all but the last 24 tokens; the prefill node only the first
        // turn (512 tokens), and the decode node would pull 2 new blocks.
        let locals = [
            LocalOption {
                decode: 10,
                hits: 1000,
                streams: 0,
            },
            LocalOption {
                decode: 11,
                hits: 0,
                streams: 0,
            },
        ];
        let decision = d.decide(1024, &remote(512, 2), &locals);
        assert_eq!(decision.path, Path::Local);
        assert_eq!(decision.local, Some(0));
        assert_eq!(decision.reason, Reason::EstimatedCost);
    }

    #[test]
    fn a_cold_decode_node_leaves_the_prompt_to_a_warm_prefill_node() {
        let d = measured();
        let local = LocalOption {
            decode: 10,
            hits: 0,
            streams: 0,
        };
        let decision = d.decide(1024, &remote(1008, 64), &[local]);
        assert_eq!(decision.path, Path::Remote);
    }

    #[test]
    fn busy_streams_on_the_decode_node_tip_the_balance_to_remote() {
        let d = measured();
        let idle = LocalOption {
            decode: 10,
            hits: 512,
            streams: 0,
        };
        let busy = LocalOption {
            streams: 16,
            ..idle
        };
        assert_eq!(d.decide(1024, &remote(0, 32), &[idle]).path, Path::Local);
        assert_eq!(d.decide(1024, &remote(0, 32), &[busy]).path, Path::Remote);
    }

    #[test]
    fn a_measured_slowdown_replaces_the_assumed_stall() {
        let d = measured();
        let busy = LocalOption {
            decode: 10,
            hits: 512,
            streams: 16,
        };
        let remote = RemoteOption {
            streams: 16,
            ..remote(0, 32)
        };
        // Assumed: computing on the decode node stalls its 16 streams; elsewhere does not.
        assert_eq!(d.decide(1024, &remote, &[busy]).path, Path::Remote);
        // Measured on shared hardware: both slow the node's steps by a fifth.
        quiet_and_busy_steps(&d, 0.008, 0.010);
        let elsewhere = d.costs.queue(0, 1);
        d.costs.stepped(10, 0.010);
        drop(elsewhere);
        assert_eq!(d.decide(1024, &remote, &[busy]).path, Path::Local);
    }

    #[test]
    fn a_pull_measured_to_slow_the_streams_counts_against_the_remote_path() {
        let d = measured();
        let cold = LocalOption {
            decode: 10,
            hits: 0,
            streams: 16,
        };
        let remote = RemoteOption {
            streams: 16,
            ..remote(1008, 64)
        };
        quiet_and_busy_steps(&d, 0.008, 0.010);
        // Until a pull is seen to slow the node, the warm prefill node wins.
        assert_eq!(d.decide(1024, &remote, &[cold]).path, Path::Remote);
        // Pulls measured to halve the node's step rate: 16 streams wait for half the
        // transfer, dearer than computing the whole prompt here.
        let pull = d.costs.pull(10);
        d.costs.stepped(10, 0.016);
        drop(pull);
        let decision = d.decide(1024, &remote, &[cold]);
        assert_eq!(decision.path, Path::Local, "{decision:?}");
    }

    #[test]
    fn work_queued_on_a_node_counts_against_its_path() {
        let d = measured();
        let local = LocalOption {
            decode: 10,
            hits: 0,
            streams: 0,
        };
        // Both compute the whole prompt; the transfer makes remote dearer... unless local
        // has a queue of its own.
        assert_eq!(d.decide(1024, &remote(0, 64), &[local]).path, Path::Local);
        let _queued = d.costs.queue(10, 4096);
        assert_eq!(d.decide(1024, &remote(0, 64), &[local]).path, Path::Remote);
    }
}
