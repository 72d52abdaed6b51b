//! [`Backend::prompt_logprobs`](pd_engine::backend::Backend::prompt_logprobs) on the device:
//! the `prompt_logprobs` kernel (`prompt.cu`, sharing the sampling kernels' log-sum-exp and
//! top-k code) scores each prompt position where its logits are, so a chunk of a request with
//! `prompt_logprobs` copies 180 bytes per position to the host instead of a row of vocabulary
//! size (608 KB for Qwen3), and the host no longer sums and ranks those rows.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use pd_engine::sampling::{PromptLogprob, PromptLogprobRow};

use super::sample::{OUTPUTS, THREADS, decode_top};
use super::{CudaBackend, CudaTensor};

/// Words per row of the kernel's parameters: logits row, next token, alternatives.
const PARAMS: usize = 3;

impl CudaBackend {
    pub(super) fn prompt_logprobs_on_device(
        &self,
        logits: &CudaTensor,
        rows: &[PromptLogprobRow],
        vocab_limit: usize,
    ) -> Vec<PromptLogprob> {
        if rows.is_empty() {
            return Vec::new();
        }
        let limit = vocab_limit.min(logits.cols);
        assert!(limit > 0, "prompt_logprobs: no scored columns");
        let params = encode(rows, logits.rows);
        let params = self.upload(&params);
        let out = self.alloc::<u32>(OUTPUTS * rows.len());
        let (cols, limit) = (logits.cols as i32, limit as i32);
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.prompt_logprobs);
        b.arg(logits.dense())
            .arg(&cols)
            .arg(&limit)
            .arg(&params)
            .arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("prompt_logprobs", b, cfg);
        let mut host = vec![0u32; OUTPUTS * rows.len()];
        self.dev
            .stream
            .memcpy_dtoh(&*out, &mut host)
            .unwrap_or_else(|e| self.fail("copy prompt logprobs to host", e));
        self.synchronize();
        drop(params);
        decode(&host)
    }
}

/// The kernel's parameters: per row its index, the next prompt token and how many
/// alternatives it lists.
///
/// # Panics
/// If a row is past the logits' `rows`, or an index does not fit the kernel's 32 bits.
fn encode(rows: &[PromptLogprobRow], logits_rows: usize) -> Vec<u32> {
    let mut params = Vec::with_capacity(PARAMS * rows.len());
    for r in rows {
        assert!(r.row < logits_rows, "prompt_logprobs: row in range");
        let row = u32::try_from(r.row).expect("prompt_logprobs: row index fits 32 bits");
        params.extend([row, r.next_token, r.top]);
    }
    params
}

fn decode(out: &[u32]) -> Vec<PromptLogprob> {
    out.chunks_exact(OUTPUTS)
        .map(|o| PromptLogprob {
            token_id: o[0],
            logprob: f32::from_bits(o[1]),
            top: decode_top(o),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use pd_engine::sampling::TokenLogprob;

    use super::*;

    #[test]
    fn rows_travel_as_three_words_and_come_back_as_scores() {
        let rows = [
            PromptLogprobRow {
                row: 2,
                next_token: 151_000,
                top: 0,
            },
            PromptLogprobRow {
                row: 0,
                next_token: 7,
                top: 20,
            },
        ];
        assert_eq!(encode(&rows, 3), [2, 151_000, 0, 0, 7, 20]);
        let mut out = vec![0u32; 2 * OUTPUTS];
        out[..4].copy_from_slice(&[151_000, (-3.5f32).to_bits(), 0, 0]);
        out[OUTPUTS..OUTPUTS + 9].copy_from_slice(&[
            7,
            f32::NEG_INFINITY.to_bits(),
            0,
            0,
            2,
            4,
            (-0.25f32).to_bits(),
            9,
            (-1.5f32).to_bits(),
        ]);
        let scores = decode(&out);
        assert_eq!(
            scores[0],
            PromptLogprob {
                token_id: 151_000,
                logprob: -3.5,
                top: vec![],
            }
        );
        assert_eq!(scores[1].logprob, f32::NEG_INFINITY);
        assert_eq!(
            scores[1].top,
            [
                TokenLogprob {
                    token_id: 4,
                    logprob: -0.25
                },
                TokenLogprob {
                    token_id: 9,
                    logprob: -1.5
                }
            ]
        );
    }

    #[test]
    #[should_panic(expected = "row in range")]
    fn a_row_past_the_logits_is_refused_before_any_launch() {
        let row = PromptLogprobRow {
            row: 3,
            next_token: 0,
            top: 0,
        };
        encode(&[row], 3);
    }
}
