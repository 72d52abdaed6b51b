#!/usr/bin/env python3
"""Independent numpy reference of the Qwen3 and Qwen3-MoE forward pass (no torch, no transformers).

It reads a Hugging Face model directory by itself (config.json in either dialect, a
single model.safetensors with F32 / BF16 / F16 tensors) and computes logits for a
prompt with plain numpy, written from the math rather than from HF's code, so it can
cross-check the golden fixtures made by make_golden.py. Qwen3-MoE experts may be stored
per expert (the published layout) or fused (experts.gate_up_proj / experts.down_proj).

    python numpy_qwen3.py engine/tests/fixtures/golden/tiny-gqa      # check one fixture
    python numpy_qwen3.py engine/tests/fixtures/golden/*             # check all

The check compares against golden.safetensors / golden.json in the same directory:
logits at every prompt position, logits at every greedy step, and the greedy tokens.
Needs only numpy (any 1.2x/2.x).
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------
# loading


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 exactly (bf16 is the top half of an f32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Minimal safetensors reader: 8-byte little-endian header length, JSON header,
    then raw little-endian tensor bytes at [begin, end) offsets relative to the data start.
    Every tensor comes back as float32 (bf16/f16 upcast exactly)."""
    data = Path(path).read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    base = 8 + hlen
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        buf = data[base + begin : base + end]
        shape = info["shape"]
        dt = info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(buf, dtype="<f4").astype(np.float32)
        elif dt == "BF16":
            arr = _bf16_to_f32(np.frombuffer(buf, dtype="<u2"))
        elif dt == "F16":
            arr = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        else:
            raise ValueError(f"{name}: unsupported dtype {dt}")
        out[name] = arr.reshape(shape)
    return out


@dataclass
class Cfg:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    # Qwen3-MoE (model_type qwen3_moe); num_experts == 0 means every layer is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple = ()

    @staticmethod
    def from_json(d: dict) -> "Cfg":
        # Two dialects exist: transformers >= 5 writes rope_parameters: {rope_theta, rope_type};
        # published Qwen3 checkpoints (transformers 4.5x) write a top-level rope_theta.
        rp = d.get("rope_parameters") or {}
        rope_theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rp.get("rope_type", (d.get("rope_scaling") or {}).get("rope_type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type} not supported by this reference")
        if d.get("use_sliding_window"):
            raise ValueError("sliding window not supported by this reference")
        if d.get("attention_bias"):
            raise ValueError("attention_bias not supported by this reference")
        heads = d["num_attention_heads"]
        moe = {}
        if d.get("model_type") == "qwen3_moe":
            # published checkpoints write num_experts; transformers 5 writes num_local_experts
            n = d.get("num_experts", d.get("num_local_experts", 0))
            step = d.get("decoder_sparse_step", 1)
            dense = d.get("mlp_only_layers") or []
            moe = dict(
                num_experts=n,
                num_experts_per_tok=d["num_experts_per_tok"] if n else 0,
                moe_intermediate_size=d["moe_intermediate_size"] if n else 0,
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                # as Qwen3MoeDecoderLayer decides: a sparse MoE block, else a dense MLP
                sparse_layers=tuple(i for i in range(d["num_hidden_layers"])
                                    if i not in dense and n > 0 and (i + 1) % step == 0),
            )
        elif d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"model_type {d.get('model_type')} not supported by this reference")
        return Cfg(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            **moe,
        )


def load_model(model_dir: str | Path) -> tuple[Cfg, dict[str, np.ndarray]]:
    model_dir = Path(model_dir)
    cfg = Cfg.from_json(json.loads((model_dir / "config.json").read_text()))
    w = load_safetensors(model_dir / "model.safetensors")
    if cfg.tie_word_embeddings:
        # tied checkpoints do not store lm_head.weight at all
        w.setdefault("lm_head.weight", w["model.embed_tokens.weight"])
    return cfg, unfuse_experts(w)


def unfuse_experts(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fused experts (transformers 5 in memory): experts.gate_up_proj [E, 2I, H] holds expert e's
    gate rows then its up rows, experts.down_proj [E, H, I]. Split them, in place, into the
    published per-expert names experts.{e}.{gate,up,down}_proj.weight."""
    for name in [n for n in w if n.endswith(".mlp.experts.gate_up_proj")]:
        p = name[: -len("gate_up_proj")]
        gate_up, down = w.pop(name), w.pop(p + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            w[f"{p}{e}.gate_proj.weight"] = gate_up[e, :inter]
            w[f"{p}{e}.up_proj.weight"] = gate_up[e, inter:]
            w[f"{p}{e}.down_proj.weight"] = down[e]
    return w


# ---------------------------------------------------------------------------
# math


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def mlp(h: np.ndarray, W: dict[str, np.ndarray], p: str) -> np.ndarray:
    """SwiGLU: down(silu(gate(h)) * up(h)); p is the prefix up to and including 'mlp.'."""
    return (silu(h @ W[p + "gate_proj.weight"].T) * (h @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def moe_mlp(cfg: Cfg, h: np.ndarray, W: dict[str, np.ndarray], p: str) -> np.ndarray:
    """Qwen3-MoE sparse block over h [T, hidden] (no shared expert):
    router logits h @ gate.T [T, E]; softmax over ALL experts (in the compute dtype); the k
    experts of highest probability; their probabilities divided by their sum iff norm_topk_prob;
    out = sum over the chosen experts, in ascending expert index (as HF's eager loop adds them),
    of weight * SwiGLU_e(h)."""
    logits = h @ W[p + "gate.weight"].T
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = z / z.sum(axis=-1, keepdims=True)
    k = cfg.num_experts_per_tok
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, k]; a tie picks the lower index
    wts = np.take_along_axis(probs, top, axis=-1)
    if cfg.norm_topk_prob:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(cfg.num_experts):
        rows, slot = np.nonzero(top == e)
        if len(rows):
            out[rows] += mlp(h[rows], W, f"{p}experts.{e}.") * wts[rows, slot][:, None]
    return out


def rope_cos_sin(cfg: Cfg, positions: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    d = cfg.head_dim
    # inv_freq[i] = theta^(-2i/d), i = 0 .. d/2-1; each frequency serves the pair (i, i + d/2)
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    ang = np.concatenate([ang, ang], axis=-1)  # [T, d]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [heads, T, d]. 'rotate half' (GPT-NeoX) layout, not interleaved pairs."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None] + rot * sin[None]


def forward(cfg: Cfg, w: dict[str, np.ndarray], ids: list[int], dtype=np.float64) -> np.ndarray:
    """Full causal forward over `ids` (positions 0..T-1). Returns logits [T, vocab]."""
    W = {k: v.astype(dtype) for k, v in w.items()}
    T = len(ids)
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = nh // nkv
    eps = cfg.rms_norm_eps
    cos, sin = rope_cos_sin(cfg, np.arange(T), dtype)
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)  # True above the diagonal = masked

    x = W["model.embed_tokens.weight"][np.asarray(ids)]  # [T, H], no scaling
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        h = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        q = rms_norm(q, W[p + "self_attn.q_norm.weight"], eps)  # per head, over head_dim
        k = rms_norm(k, W[p + "self_attn.k_norm.weight"], eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = np.empty((nh, T, hd), dtype=dtype)
        for head in range(nh):
            kv = head // group  # query heads [kv*group, (kv+1)*group) share kv head kv
            s = (q[head] @ k[kv].T) / np.sqrt(np.asarray(hd, dtype=dtype))
            s = np.where(causal, -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            out[head] = pr @ v[kv]
        attn = out.transpose(1, 0, 2).reshape(T, nh * hd)  # heads concatenated in order
        x = x + attn @ W[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        if l in cfg.sparse_layers:
            x = x + moe_mlp(cfg, h, W, p + "mlp.")
        else:
            x = x + mlp(h, W, p + "mlp.")
    x = rms_norm(x, W["model.norm.weight"], eps)
    return x @ W["lm_head.weight"].T


def greedy(cfg: Cfg, w: dict[str, np.ndarray], ids: list[int], n: int, dtype=np.float64):
    """n greedy tokens by full recomputation; returns (tokens, logits [n, vocab])."""
    seq = list(ids)
    toks, rows = [], []
    for _ in range(n):
        row = forward(cfg, w, seq, dtype)[-1]
        t = int(np.argmax(row))
        toks.append(t)
        rows.append(row)
        seq.append(t)
    return toks, np.stack(rows)


# ---------------------------------------------------------------------------
# fixture check


def check_fixture(fixture_dir: str | Path, dtype=np.float64, verbose: bool = True) -> dict:
    """Compare the numpy forward with golden.safetensors/golden.json in fixture_dir."""
    fixture_dir = Path(fixture_dir)
    cfg, w = load_model(fixture_dir)
    meta = json.loads((fixture_dir / "golden.json").read_text())
    gold = load_safetensors(fixture_dir / "golden.safetensors")
    max_prompt, max_greedy, greedy_ok = 0.0, 0.0, True
    for i, ids in enumerate(meta["prompts"]):
        lg = forward(cfg, w, ids, dtype)
        max_prompt = max(max_prompt, float(np.abs(lg - gold[f"prompt{i}.logits"]).max()))
        # the greedy step logits: one forward over prompt + greedy[:-1] gives all of them
        seq = ids + meta["greedy"][i][:-1]
        full = forward(cfg, w, seq, dtype)[len(ids) - 1 :]
        max_greedy = max(max_greedy, float(np.abs(full - gold[f"prompt{i}.greedy_logits"]).max()))
        greedy_ok &= [int(t) for t in np.argmax(full, axis=-1)] == meta["greedy"][i]
    res = {"max_abs_diff_prompt_logits": max_prompt, "max_abs_diff_greedy_logits": max_greedy,
           "greedy_match": bool(greedy_ok)}
    if verbose:
        print(f"{fixture_dir.name:16s} numpy({np.dtype(dtype).name}) vs HF: "
              f"prompt max|d|={max_prompt:.3g} greedy-step max|d|={max_greedy:.3g} "
              f"greedy tokens {'match' if greedy_ok else 'DIFFER'}")
    return res


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    bad = False
    for d in argv:
        for dt in (np.float64, np.float32):
            r = check_fixture(d, dt)
            bad |= not (r["greedy_match"] and r["max_abs_diff_prompt_logits"] < 1e-4
                        and r["max_abs_diff_greedy_logits"] < 1e-4)
    print("FAIL" if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
