//! [`Backend::sample`](pd_engine::backend::Backend::sample) on the device: the `sample_rows`
//! kernel (greedy, top-k <= 64; `sample.cu`) and the `sample_dense` kernel (no top-k or a
//! larger one; `sample_dense.cu`) choose each row's token (and its top log-probabilities) where the logits
//! are, so a step copies 45 words per sequence to the host instead of a row of vocabulary
//! size (608 KB for Qwen3). Rows
//! with logits processors first get an edited copy (`reshape.cu`: `reshape_copy`, then
//! `reshape_edit` for their per-id edits). The choice follows
//! `pd_engine::sampling::device::sample_row` bit for bit.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use pd_engine::sampling::device::MAX_DEVICE_TOP_P_CANDIDATES;
use pd_engine::sampling::{
    DeviceSample, DeviceSampleRow, DeviceSampling, MAX_LOGPROBS, TokenLogprob,
};

use super::{CudaBackend, CudaTensor};

/// Threads per sampled row: the whole vocabulary is scanned by one block.
pub(super) const THREADS: u32 = 1024;

/// Threads per block of the reshape kernels.
const RESHAPE_THREADS: u32 = 256;

/// Most blocks along a row in `reshape_copy` (each thread then copies a few columns).
const RESHAPE_COPY_BLOCKS: u32 = 64;

/// Doubles per row in the kernel's parameter array (`SAMPLE_PARAMS` in `sample.cuh`).
const PARAMS: usize = 8;

/// Words per edited row (`RESHAPE_ROW`) and per edit (`RESHAPE_EDIT`) in `reshape.cu`.
const RESHAPE_ROW: usize = 4;
const RESHAPE_EDIT: usize = 5;

/// Most top log-probabilities per row (`SAMPLE_MAX_LOGPROBS`).
const MAX_TOP: usize = MAX_LOGPROBS as usize;

/// Words per row in the kernels' output (`SAMPLE_OUTPUTS`): token, logprob bits, used draw,
/// handed back, the number of top log-probabilities and an (id, logprob bits) pair each.
pub(super) const OUTPUTS: usize = 5 + 2 * MAX_TOP;

/// Weights summed together by `sample_dense` (`DENSE_CHUNK`).
const DENSE_CHUNK: usize = 64;

/// `sample_dense`'s scratch words per row (`dense_scratch_words` in `sample_dense.cu`).
fn dense_scratch_words(vocab_limit: usize) -> usize {
    vocab_limit + vocab_limit.div_ceil(DENSE_CHUNK) + 2 * MAX_DEVICE_TOP_P_CANDIDATES
}

/// The kernels' inputs for one call.
#[derive(Debug, Default, PartialEq)]
struct Encoded {
    /// [`PARAMS`] per row of `sample_rows`, in the order of [`Encoded::small`].
    params: Vec<f64>,
    /// [`PARAMS`] per row of `sample_dense`, in the order of [`Encoded::dense`].
    dense_params: Vec<f64>,
    /// Which of the call's rows each kernel samples.
    small: Vec<usize>,
    dense: Vec<usize>,
    /// [`RESHAPE_ROW`] per edited row.
    shaped_rows: Vec<u32>,
    /// [`RESHAPE_EDIT`] per edit.
    edits: Vec<u32>,
}

impl Encoded {
    fn shaped(&self) -> usize {
        self.shaped_rows.len() / RESHAPE_ROW
    }

    fn edits(&self) -> usize {
        self.edits.len() / RESHAPE_EDIT
    }
}

impl CudaBackend {
    pub(super) fn sample_on_device(
        &self,
        logits: &CudaTensor,
        rows: &[DeviceSampleRow],
        vocab_limit: usize,
    ) -> Vec<DeviceSample> {
        if rows.is_empty() {
            return Vec::new();
        }
        let limit = vocab_limit.min(logits.cols);
        assert!(limit > 0, "sample: no candidate columns");
        assert!(
            rows.iter().all(|r| r.row < logits.rows),
            "sample: row in range"
        );
        let enc = encode(rows, limit);
        let (cols, limit_i) = (logits.cols as i32, limit as i32);
        let shaped = (enc.shaped() > 0).then(|| {
            let shaped = self.alloc::<f32>(enc.shaped() * limit);
            let shaped_rows = self.upload(&enc.shaped_rows);
            let mut b = self
                .dev
                .stream
                .launch_builder(&self.dev.kernels.reshape_copy);
            b.arg(logits.dense())
                .arg(&cols)
                .arg(&limit_i)
                .arg(&shaped_rows)
                .arg(&shaped);
            let per_row = (limit as u32)
                .div_ceil(RESHAPE_THREADS)
                .min(RESHAPE_COPY_BLOCKS);
            let cfg = LaunchConfig {
                grid_dim: (per_row, enc.shaped() as u32, 1),
                block_dim: (RESHAPE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("reshape_copy", b, cfg);
            if enc.edits() > 0 {
                let edits = self.upload(&enc.edits);
                let n_edits = enc.edits() as i32;
                let mut b = self
                    .dev
                    .stream
                    .launch_builder(&self.dev.kernels.reshape_edit);
                b.arg(logits.dense())
                    .arg(&cols)
                    .arg(&limit_i)
                    .arg(&shaped_rows)
                    .arg(&edits)
                    .arg(&n_edits)
                    .arg(&shaped);
                let cfg = LaunchConfig {
                    grid_dim: ((enc.edits() as u32).div_ceil(RESHAPE_THREADS), 1, 1),
                    block_dim: (RESHAPE_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launch("reshape_edit", b, cfg);
            }
            shaped
        });
        // No edited rows: the kernel never reads `shaped`, a null pointer stands in.
        let shaped_ptr = shaped.as_ref().map_or(0u64, |s| self.ptr(s));
        let out = self.alloc::<u32>(OUTPUTS * rows.len());
        let block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // `sample_rows` writes the first rows of `out`, `sample_dense` the rest.
        let params = (!enc.small.is_empty()).then(|| self.upload(&enc.params));
        if let Some(params) = &params {
            let mut b = self
                .dev
                .stream
                .launch_builder(&self.dev.kernels.sample_rows);
            b.arg(logits.dense())
                .arg(&cols)
                .arg(&shaped_ptr)
                .arg(&limit_i)
                .arg(params)
                .arg(&out);
            let cfg = LaunchConfig {
                grid_dim: (enc.small.len() as u32, 1, 1),
                ..block
            };
            self.launch("sample_rows", b, cfg);
        }
        let dense = (!enc.dense.is_empty()).then(|| {
            let params = self.upload(&enc.dense_params);
            let scratch = self.alloc::<f32>(enc.dense.len() * dense_scratch_words(limit));
            let out_ptr = self.ptr(&out) + (OUTPUTS * enc.small.len() * 4) as u64;
            let mut b = self
                .dev
                .stream
                .launch_builder(&self.dev.kernels.sample_dense);
            b.arg(logits.dense())
                .arg(&cols)
                .arg(&shaped_ptr)
                .arg(&limit_i)
                .arg(&params)
                .arg(&scratch)
                .arg(&out_ptr);
            let cfg = LaunchConfig {
                grid_dim: (enc.dense.len() as u32, 1, 1),
                ..block
            };
            self.launch("sample_dense", b, cfg);
            (params, scratch)
        });
        let mut host = vec![0u32; OUTPUTS * rows.len()];
        self.dev
            .stream
            .memcpy_dtoh(&*out, &mut host)
            .unwrap_or_else(|e| self.fail("copy sampled tokens to host", e));
        self.synchronize();
        drop((shaped, params, dense));
        let mut samples = vec![DeviceSample::NEEDS_HOST; rows.len()];
        for (&i, s) in enc.small.iter().chain(&enc.dense).zip(decode(&host)) {
            samples[i] = s;
        }
        samples
    }
}

/// The kernels' parameters: per row its index, k (0 = greedy for `sample_rows`, no top-k
/// for `sample_dense`), 1/temperature, top_p, the uniform draw, the min-p margin and its
/// edited row (-1: none), all exact as f64; per edited row and per edit their words. Edits
/// of ids at or past `limit` are dropped (the reference cuts the row there first).
fn encode(rows: &[DeviceSampleRow], limit: usize) -> Encoded {
    let mut enc = Encoded {
        params: Vec::with_capacity(PARAMS * rows.len()),
        ..Default::default()
    };
    for (i, r) in rows.iter().enumerate() {
        let (dense, k, inv_t, top_p, margin, uniform) = match r.method {
            DeviceSampling::Greedy => (false, 0, 1.0, 1.0, f32::NEG_INFINITY, 0.0),
            DeviceSampling::TopK {
                k,
                inv_temperature,
                top_p,
                min_p_margin,
                uniform,
            } => (false, k, inv_temperature, top_p, min_p_margin, uniform),
            DeviceSampling::Dense {
                top_k,
                inv_temperature,
                top_p,
                min_p_margin,
                uniform,
            } => (true, top_k, inv_temperature, top_p, min_p_margin, uniform),
        };
        let shaped_row = match r.reshape {
            Some(reshape) => {
                let j = enc.shaped() as u32;
                enc.shaped_rows.extend([
                    r.row as u32,
                    u32::from(reshape.allowed_only),
                    reshape.repetition_penalty.to_bits(),
                    reshape.presence_penalty.to_bits(),
                ]);
                for e in reshape.edits.iter().filter(|e| (e.id as usize) < limit) {
                    enc.edits
                        .extend([j, e.id, e.ops, e.bias.to_bits(), e.frequency.to_bits()]);
                }
                f64::from(j)
            }
            None => -1.0,
        };
        let params = if dense {
            enc.dense.push(i);
            &mut enc.dense_params
        } else {
            enc.small.push(i);
            &mut enc.params
        };
        params.extend([
            r.row as f64,
            f64::from(k),
            f64::from(inv_t),
            f64::from(top_p),
            uniform,
            f64::from(margin),
            shaped_row,
            f64::from(r.top_logprobs.min(MAX_LOGPROBS)),
        ]);
    }
    enc
}

fn decode(out: &[u32]) -> Vec<DeviceSample> {
    out.chunks_exact(OUTPUTS)
        .map(|o| DeviceSample {
            token_id: o[0],
            logprob: f32::from_bits(o[1]),
            used_draw: o[2] != 0,
            needs_host: o[3] != 0,
            top: decode_top(o),
        })
        .collect()
}

/// The top log-probabilities of one row of output ([`OUTPUTS`] words).
pub(super) fn decode_top(o: &[u32]) -> Vec<TokenLogprob> {
    o[5..]
        .chunks_exact(2)
        .take((o[4] as usize).min(MAX_TOP))
        .map(|p| TokenLogprob {
            token_id: p[0],
            logprob: f32::from_bits(p[1]),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use pd_engine::sampling::{Reshape, TokenEdit};

    use super::*;

    #[test]
    fn parameters_round_trip_exactly() {
        let reshape = Reshape {
            allowed_only: true,
            repetition_penalty: 1.3,
            presence_penalty: -0.5,
            edits: vec![
                TokenEdit {
                    id: 9,
                    ops: 3,
                    bias: 2.5,
                    frequency: 0.0,
                },
                TokenEdit {
                    id: 500,
                    ops: 1,
                    bias: 0.0,
                    frequency: 0.0,
                },
            ],
        };
        let rows = [
            DeviceSampleRow {
                row: 3,
                method: DeviceSampling::Greedy,
                reshape: None,
                top_logprobs: 0,
            },
            DeviceSampleRow {
                row: 0,
                method: DeviceSampling::TopK {
                    k: 64,
                    inv_temperature: 1.0 / 0.7,
                    top_p: 0.95,
                    min_p_margin: 0.7 * 0.05f32.ln(),
                    uniform: 0.123_456_789_012_345_67,
                },
                reshape: Some(&reshape),
                top_logprobs: 3,
            },
        ];
        let enc = encode(&rows, 100);
        let p = &enc.params;
        assert_eq!(p.len(), 2 * PARAMS);
        assert_eq!(&p[..2], &[3.0, 0.0]);
        assert_eq!(p[5], f64::NEG_INFINITY);
        assert_eq!(p[6], -1.0, "no edited row");
        // The kernel narrows these back to f32 exactly.
        assert_eq!(p[PARAMS + 2] as f32, 1.0f32 / 0.7);
        assert_eq!(p[PARAMS + 3] as f32, 0.95f32);
        assert_eq!(p[PARAMS + 4], 0.123_456_789_012_345_67);
        assert_eq!(p[PARAMS + 5] as f32, 0.7 * 0.05f32.ln());
        assert_eq!(p[PARAMS + 6], 0.0, "edited row 0");
        assert_eq!((p[7], p[PARAMS + 7]), (0.0, 3.0), "top log-probabilities");
        assert_eq!(
            enc.shaped_rows,
            [0, 1, 1.3f32.to_bits(), (-0.5f32).to_bits()]
        );
        // Id 500 is past the 100 candidate columns.
        assert_eq!(enc.edits, [0, 9, 3, 2.5f32.to_bits(), 0]);
        assert_eq!(
            (enc.small.as_slice(), enc.dense.as_slice()),
            (&[0, 1][..], &[][..])
        );
        let mut out = vec![0u32; 2 * OUTPUTS];
        out[..7].copy_from_slice(&[7, (-1.5f32).to_bits(), 1, 0, 1, 9, (-2.0f32).to_bits()]);
        out[OUTPUTS + 3] = 1;
        let s = decode(&out);
        assert_eq!(
            s[0],
            DeviceSample {
                token_id: 7,
                logprob: -1.5,
                used_draw: true,
                needs_host: false,
                top: vec![TokenLogprob {
                    token_id: 9,
                    logprob: -2.0
                }],
            }
        );
        assert!(!s[1].used_draw && s[1].needs_host);
    }

    #[test]
    fn dense_rows_go_to_their_own_kernel_in_order() {
        let dense = DeviceSampling::Dense {
            top_k: 0,
            inv_temperature: 1.25,
            top_p: 0.9,
            min_p_margin: f32::NEG_INFINITY,
            uniform: 0.25,
        };
        let row = |row, method| DeviceSampleRow {
            row,
            method,
            reshape: None,
            top_logprobs: 0,
        };
        let rows = [row(4, dense), row(2, DeviceSampling::Greedy), row(0, dense)];
        let enc = encode(&rows, 10);
        assert_eq!((enc.small, enc.dense), (vec![1], vec![0, 2]));
        assert_eq!(enc.params[0], 2.0);
        assert_eq!(
            enc.dense_params[..PARAMS],
            [
                4.0,
                0.0,
                1.25,
                f64::from(0.9f32),
                0.25,
                f64::NEG_INFINITY,
                -1.0,
                0.0
            ]
        );
        assert_eq!(enc.dense_params[PARAMS], 0.0);
    }
}
