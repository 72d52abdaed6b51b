//! Qwen3-MoE's sparse MLP as the backend contract sees it: the weights of one layer's
//! experts ([`NormMoe`]) and the routing of tokens to experts ([`route`]), computed the way
//! transformers computes it, and the host-routed way to run them ([`norm_moe_add_on_host`],
//! the trait's default). The ops that run the experts are [`super::Backend`]'s; this module
//! owns which rows go where, with what weight, and in what order their outputs are added.

use super::{Backend, HostMatrix};

/// One expert's SwiGLU MLP: gate / up `[expert_inter, hidden]`, down `[hidden, expert_inter]`.
pub struct Expert<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
}

/// Qwen3-MoE's sparse MLP block with the RMSNorm before it: what
/// [`super::Backend::norm_moe_add`] needs besides the residual stream `[rows, hidden]`.
pub struct NormMoe<'a, W> {
    pub hidden: usize,
    pub norm: &'a W,
    pub eps: f32,
    /// `[num_experts, hidden]`: the router (transformers' `mlp.gate`).
    pub router: &'a W,
    pub experts: &'a [Expert<W>],
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1.
    pub norm_topk_prob: bool,
}

/// The rows one expert processes and the weight its output is added with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertRows {
    /// Batch rows, ascending.
    pub rows: Vec<usize>,
    /// `weights[i]` scales the expert's output for `rows[i]`.
    pub weights: Vec<f32>,
}

/// Route each row of `router_logits` (`[rows, num_experts]`) to its `top_k` experts:
/// softmax over all experts in f32, the `top_k` largest probabilities (the lower expert
/// index first among equal ones), renormalised to sum to 1 when `norm_topk_prob`. Returns
/// one entry per expert, empty for experts no row chose.
pub fn route(router_logits: &HostMatrix, top_k: usize, norm_topk_prob: bool) -> Vec<ExpertRows> {
    let experts = router_logits.cols;
    assert!(top_k >= 1 && top_k <= experts, "top_k within the experts");
    let mut out = vec![ExpertRows::default(); experts];
    let mut probs = vec![0f32; experts];
    let mut order: Vec<usize> = (0..experts).collect();
    for row in 0..router_logits.rows {
        let logits = router_logits.row(row);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &l) in probs.iter_mut().zip(logits) {
            *p = (l - max).exp();
            sum += *p;
        }
        for p in &mut probs {
            *p /= sum;
        }
        // A stable sort keeps the lower index first among equal probabilities.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let chosen = &order[..top_k];
        let scale = if norm_topk_prob {
            chosen.iter().map(|&e| probs[e]).sum::<f32>()
        } else {
            1.0
        };
        for &e in chosen {
            out[e].rows.push(row);
            out[e].weights.push(probs[e] / scale);
        }
        order.sort_unstable();
    }
    out
}

/// [`Backend::norm_moe_add`] with the routing on the host: the norm, the router's logits
/// copied to the host and routed ([`route`]), then each chosen expert run on its rows
/// ([`Backend::select_rows`], the gate / up / SwiGLU / down ops) and its output added with
/// [`Backend::add_rows_scaled`], expert by expert in index order.
pub fn norm_moe_add_on_host<B: Backend + ?Sized>(
    backend: &B,
    x: &mut B::Tensor,
    moe: &NormMoe<'_, B::Weight>,
) {
    let n = backend.rms_norm(x, moe.norm, moe.hidden, moe.eps);
    let router_logits = backend.to_host(&backend.linear(&n, moe.router));
    let routes = route(&router_logits, moe.top_k, moe.norm_topk_prob);
    for (expert, route) in moe.experts.iter().zip(&routes) {
        if route.rows.is_empty() {
            continue;
        }
        let rows = backend.select_rows(&n, &route.rows);
        let [gate, up] = backend.linear_shared(&rows, [&expert.gate, &expert.up]);
        let y = backend.linear(&backend.silu_mul(&gate, &up), &expert.down);
        backend.add_rows_scaled(x, &y, &route.rows, &route.weights);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(rows: &[&[f32]]) -> HostMatrix {
        HostMatrix::from_rows(rows)
    }

    #[test]
    fn each_row_goes_to_its_top_k_experts_with_softmax_weights() {
        let m = logits(&[&[0.0, 2.0, 1.0, -1.0], &[3.0, 0.0, 0.0, 3.5]]);
        let r = route(&m, 2, false);
        assert_eq!(r[0].rows, vec![1]);
        assert_eq!(r[1].rows, vec![0]);
        assert_eq!(r[2].rows, vec![0]);
        assert_eq!(r[3].rows, vec![1]);
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|l| l.exp()).sum();
        assert!((r[1].weights[0] - 2f32.exp() / z).abs() < 1e-6);
        assert!((r[2].weights[0] - 1f32.exp() / z).abs() < 1e-6);
        // Without renormalisation the two weights sum to less than 1.
        assert!(r[1].weights[0] + r[2].weights[0] < 0.95);
    }

    #[test]
    fn renormalised_weights_sum_to_one_and_keep_their_ratio() {
        let m = logits(&[&[0.0, 2.0, 1.0, -1.0]]);
        let r = route(&m, 2, true);
        let (a, b) = (r[1].weights[0], r[2].weights[0]);
        assert!((a + b - 1.0).abs() < 1e-6);
        assert!((a / b - 1f32.exp()).abs() < 1e-5);
        assert!(r[0].rows.is_empty() && r[3].rows.is_empty());
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_rows_stay_ascending() {
        let m = logits(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 1.0], &[0.0, 5.0, 0.0]]);
        let r = route(&m, 1, true);
        assert_eq!(r[0].rows, vec![0, 1]);
        assert_eq!(r[0].weights, vec![1.0, 1.0]);
        assert_eq!(r[1].rows, vec![2]);
        assert!(r[2].rows.is_empty());
    }
}
