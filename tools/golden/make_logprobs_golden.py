"""Log-probabilities over the model's whole output vocabulary, as transformers computes them.

Loads a `synthetic:tiny` model directory (seeded random weights with Qwen3's real vocabulary:
151,936 output rows, of which the tokenizer knows the first 151,669) with
`Qwen3ForCausalLM` in f32, runs one prompt plus a greedy continuation, and writes, for every
prompt position after the first and every generated token, the token's log-probability and
the best alternatives, with log-softmax taken over all 151,936 rows (the padding rows
included). It also records each position's padding mass, so a test can tell this
normalization from one over the tokenizer's ids only.

The directory is the one `pdctl run --model synthetic:tiny` materializes (under
`$PD_CACHE_DIR/synthetic/tiny-seed0-v1`, else `~/.cache/pd-cluster/...`). Run by hand, with
the venv of tools/golden/README.md:

    /work/venv-golden/bin/python tools/golden/make_logprobs_golden.py \
        --model-dir ~/.cache/pd-cluster/synthetic/tiny-seed0-v1 \
        --out pdctl/tests/fixtures/logprobs_full_vocab.json
"""

import argparse
import json
import math

import numpy as np
import torch
import transformers
from transformers import Qwen3ForCausalLM

# Token ids of a short English sentence under the Qwen3 tokenizer, then a few ids spread over
# the vocabulary; the test sends them with --token-ids, so no tokenizer runs here.
PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13, 1024, 77, 151000, 42, 9001]
GENERATED = 4
TOP = 5
# Ids below this are the tokenizer's; the rows past it are the checkpoint's padding.
TOKENIZER_VOCAB = 151669


def scored(row64: torch.Tensor, token: int) -> dict:
    """One position: the token's log-probability over all rows and the TOP best real tokens."""
    logp = torch.log_softmax(row64, dim=-1)
    real = logp[:TOKENIZER_VOCAB]
    order = sorted(range(TOKENIZER_VOCAB), key=lambda i: (-float(real[i]), i))[: TOP + 1]
    padding_mass = float(torch.exp(logp[TOKENIZER_VOCAB:]).sum())
    return {
        "token_id": token,
        "logprob": float(logp[token]),
        "top": [{"token_id": i, "logprob": float(real[i])} for i in order[:TOP]],
        # The smallest gap between consecutive listed logprobs (and the next one): how much
        # rounding the listed order can take.
        "top_min_gap": min(float(real[a] - real[b]) for a, b in zip(order, order[1:])),
        "padding_mass": padding_mass,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    model = Qwen3ForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert model.config.vocab_size == 151936, model.config.vocab_size

    tokens = list(PROMPT)
    prompt_positions = []
    generated = []
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
        for p in range(len(PROMPT) - 1):
            prompt_positions.append(scored(logits[p], PROMPT[p + 1]))
        for _ in range(GENERATED):
            row = model(torch.tensor([tokens])).logits[0, -1].double()
            real = row[:TOKENIZER_VOCAB]
            best = int(torch.argmax(real))
            two = torch.topk(real, 2).values
            entry = scored(row, best)
            entry["greedy_margin"] = float(two[0] - two[1])
            generated.append(entry)
            tokens.append(best)

    out = {
        "model": "synthetic:tiny (seed 0)",
        "prompt_token_ids": PROMPT,
        "logprobs_top": TOP,
        "prompt_logprobs": prompt_positions,
        "generated": generated,
        "normalization": "log_softmax over all vocab_size rows, in float64 of HF's f32 logits",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
        },
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    worst_margin = min(g["greedy_margin"] for g in generated)
    mass = [e["padding_mass"] for e in prompt_positions + generated]
    print(
        f"wrote {args.out}: greedy {tokens[len(PROMPT):]}, min greedy margin {worst_margin:.3g}, "
        f"padding mass {min(mass):.3g}..{max(mass):.3g} "
        f"(renormalizing would move logprobs by {-math.log1p(-max(mass)):.3g} nats)"
    )


if __name__ == "__main__":
    main()
