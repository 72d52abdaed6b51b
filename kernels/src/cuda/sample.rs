//! [`Backend::sample`](pd_engine::backend::Backend::sample) on the device: the `sample_rows`
//! kernel (`sample.cu`) chooses each row's token where the logits are, so a step copies
//! three words per sequence to the host instead of a row of vocabulary size (608 KB for
//! Qwen3). The choice follows `pd_engine::sampling::device::sample_row` bit for bit.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use pd_engine::sampling::{DeviceSample, DeviceSampleRow, DeviceSampling};

use super::{CudaBackend, CudaTensor};

/// Threads per sampled row: the whole vocabulary is scanned by one block.
const THREADS: u32 = 1024;

/// Doubles per row in the kernel's parameter array (`SAMPLE_PARAMS` in `sample.cu`).
const PARAMS: usize = 5;

/// Words per row in the kernel's output (`token`, logprob bits, used draw).
const OUTPUTS: usize = 3;

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
        let params = self.upload(&encode(rows));
        let out = self.alloc::<u32>(OUTPUTS * rows.len());
        let (cols, limit_i) = (logits.cols as i32, limit as i32);
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.sample_rows);
        b.arg(logits.dense())
            .arg(&cols)
            .arg(&limit_i)
            .arg(&params)
            .arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("sample_rows", b, cfg);
        let mut host = vec![0u32; OUTPUTS * rows.len()];
        self.dev
            .stream
            .memcpy_dtoh(&*out, &mut host)
            .unwrap_or_else(|e| self.fail("copy sampled tokens to host", e));
        self.synchronize();
        decode(&host)
    }
}

/// The kernel's parameters: per row its index, k (0 = greedy), 1/temperature, top_p and the
/// uniform draw, all exact as f64.
fn encode(rows: &[DeviceSampleRow]) -> Vec<f64> {
    let mut params = Vec::with_capacity(PARAMS * rows.len());
    for r in rows {
        let (k, inv_t, top_p, uniform) = match r.method {
            DeviceSampling::Greedy => (0, 1.0, 1.0, 0.0),
            DeviceSampling::TopK {
                k,
                inv_temperature,
                top_p,
                uniform,
            } => (k, inv_temperature, top_p, uniform),
        };
        params.extend([
            r.row as f64,
            f64::from(k),
            f64::from(inv_t),
            f64::from(top_p),
            uniform,
        ]);
    }
    params
}

fn decode(out: &[u32]) -> Vec<DeviceSample> {
    out.chunks_exact(OUTPUTS)
        .map(|o| DeviceSample {
            token_id: o[0],
            logprob: f32::from_bits(o[1]),
            used_draw: o[2] != 0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_round_trip_exactly() {
        let rows = [
            DeviceSampleRow {
                row: 3,
                method: DeviceSampling::Greedy,
            },
            DeviceSampleRow {
                row: 0,
                method: DeviceSampling::TopK {
                    k: 64,
                    inv_temperature: 1.0 / 0.7,
                    top_p: 0.95,
                    uniform: 0.123_456_789_012_345_67,
                },
            },
        ];
        let p = encode(&rows);
        assert_eq!(p.len(), 2 * PARAMS);
        assert_eq!(&p[..2], &[3.0, 0.0]);
        // The kernel narrows these back to f32 exactly.
        assert_eq!(p[PARAMS + 2] as f32, 1.0f32 / 0.7);
        assert_eq!(p[PARAMS + 3] as f32, 0.95f32);
        assert_eq!(p[PARAMS + 4], 0.123_456_789_012_345_67);
        let s = decode(&[7, (-1.5f32).to_bits(), 1, 0, 0, 0]);
        assert_eq!(
            s[0],
            DeviceSample {
                token_id: 7,
                logprob: -1.5,
                used_draw: true
            }
        );
        assert!(!s[1].used_draw);
    }
}
