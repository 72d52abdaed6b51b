//! Projections uploaded side by side (`load_stacked`) against the same matrices uploaded one
//! by one, and the ops that read the stacked product's column views.

use pd_engine::backend::{Backend, QkNormRope};
use pd_engine::weights::Checkpoint;
use pd_kernels::CudaBackend;
use pd_kernels::cuda::{CudaTensor, CudaWeight};

use super::{files, unit};

/// Bit-exact equality of two device tensors (copied to the host).
pub(crate) fn assert_same(what: &str, gpu: &CudaBackend, a: &CudaTensor, b: &CudaTensor) {
    let (a, b) = (gpu.to_host(a), gpu.to_host(b));
    assert_eq!((a.rows, a.cols), (b.rows, b.cols), "{what}: shape");
    assert!(a.data.iter().all(|v| v.is_finite()), "{what}: non-finite");
    assert!(
        a.data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "{what}: the two differ (stacked and one-by-one weights, or fused and separate ops)"
    );
}

/// Layer 0's projections `parts` (name, rows) of `cols` columns, uploaded side by side
/// (`load_stacked`) and one by one.
fn stacked_and_single<const N: usize>(
    gpu: &CudaBackend,
    ckpt: &Checkpoint,
    parts: [(&str, usize); N],
    cols: usize,
) -> ([CudaWeight; N], [CudaWeight; N]) {
    let names = parts.map(|(what, _)| format!("model.layers.0.{what}.weight"));
    let view = |i: usize| ckpt.tensor(&names[i], &[parts[i].1, cols]).expect("tensor");
    let stacked = gpu
        .load_stacked(std::array::from_fn(|i| (names[i].as_str(), view(i))))
        .expect("upload");
    let single = std::array::from_fn(|i| gpu.load_weight(&names[i], view(i)).expect("upload"));
    (stacked, single)
}

/// Layer 0's q/k/v and gate/up projections, each uploaded side by side and one by one
/// ([`stacked_and_single`]).
pub(crate) struct Layer0Projections {
    pub(crate) stacked_qkv: [CudaWeight; 3],
    pub(crate) single_qkv: [CudaWeight; 3],
    pub(crate) stacked_mlp: [CudaWeight; 2],
    pub(crate) single_mlp: [CudaWeight; 2],
}

pub(crate) fn layer0_projections(
    gpu: &CudaBackend,
    ckpt: &Checkpoint,
    c: &pd_engine::config::ModelConfig,
) -> Layer0Projections {
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let (stacked_qkv, single_qkv) = stacked_and_single(
        gpu,
        ckpt,
        [
            ("self_attn.q_proj", q),
            ("self_attn.k_proj", kv),
            ("self_attn.v_proj", kv),
        ],
        c.hidden_size,
    );
    let (stacked_mlp, single_mlp) = stacked_and_single(
        gpu,
        ckpt,
        [
            ("mlp.gate_proj", c.intermediate_size),
            ("mlp.up_proj", c.intermediate_size),
        ],
        c.hidden_size,
    );
    Layer0Projections {
        stacked_qkv,
        single_qkv,
        stacked_mlp,
        single_mlp,
    }
}

/// q/k/v and gate/up uploaded side by side (`load_stacked`: one GEMM, its columns split into
/// views) give bit for bit the products of the same matrices uploaded one by one (one GEMM
/// each), and the ops that read those views (q/k norm + RoPE, SiLU-and-multiply and the down
/// projection, the host copy) read the right columns of the right rows.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn stacked_projections_equal_one_by_one() {
    for model in ["synthetic:tiny", "synthetic:qwen3-0.6b"] {
        let files = files(model);
        let c = &files.config;
        let ckpt = Checkpoint::open(&files.dir).expect("checkpoint");
        let gpu = CudaBackend::open(0, 0.5).expect("cuda:0");
        let h = c.hidden_size;
        let Layer0Projections {
            stacked_qkv,
            single_qkv,
            stacked_mlp,
            single_mlp,
        } = layer0_projections(&gpu, &ckpt, c);
        let load = |what: &str, shape: &[usize]| {
            let n = format!("model.layers.0.{what}.weight");
            gpu.load_weight(&n, ckpt.tensor(&n, shape).expect("tensor"))
                .expect("upload")
        };
        let norm = load("input_layernorm", &[h]);
        let (q_norm, k_norm) = (
            load("self_attn.q_norm", &[c.head_dim]),
            load("self_attn.k_norm", &[c.head_dim]),
        );
        let down = load("mlp.down_proj", &[h, c.intermediate_size]);

        let rows = 5;
        let mut state = 11u64;
        let host: Vec<f32> = (0..rows * h).map(|_| unit(&mut state) as f32).collect();
        let x = || {
            CudaTensor::new(
                rows,
                h,
                gpu.device().stream.clone_htod(&host).expect("upload"),
            )
        };
        let eps = c.rms_norm_eps;
        let positions: Vec<u32> = (0..rows as u32).map(|r| 3 * r).collect();

        let a = gpu.norm_linear_shared(&x(), &norm, h, eps, stacked_qkv.each_ref());
        let b = gpu.norm_linear_shared(&x(), &norm, h, eps, single_qkv.each_ref());
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            assert_same(&format!("{model} {what}"), &gpu, &a[i], &b[i]);
        }
        let norm_rope = QkNormRope {
            q_norm: &q_norm,
            k_norm: &k_norm,
            positions: &positions,
            head_dim: c.head_dim,
            eps,
            theta: c.rope_theta,
        };
        let qk = |t: &[CudaTensor; 3]| gpu.qk_norm_rope(&t[0], &t[1], &norm_rope);
        let ((aq, ak), (bq, bk)) = (qk(&a), qk(&b));
        assert_same(&format!("{model} q after norm + RoPE"), &gpu, &aq, &bq);
        assert_same(&format!("{model} k after norm + RoPE"), &gpu, &ak, &bk);

        let [ag, au] = gpu.linear_shared(&x(), stacked_mlp.each_ref());
        let [bg, bu] = gpu.linear_shared(&x(), single_mlp.each_ref());
        assert_same(&format!("{model} gate"), &gpu, &ag, &bg);
        assert_same(&format!("{model} up"), &gpu, &au, &bu);
        let (mut ax, mut bx) = (x(), x());
        gpu.silu_mul_linear_add(&mut ax, &ag, &au, &down);
        gpu.silu_mul_linear_add(&mut bx, &bg, &bu, &down);
        assert_same(
            &format!("{model} residual + down(silu(gate) * up)"),
            &gpu,
            &ax,
            &bx,
        );
    }
}
