#!/usr/bin/env python3
"""PyTorch (transformers, eager CPU) reference numbers for the side-by-side CPU benchmark.

Loads a Hugging Face style checkpoint directory (config.json + *.safetensors, e.g. the one
`PD_CACHE_DIR=<cache> pdctl run --model synthetic:qwen3-0.6b ...` writes under
`<cache>/synthetic/qwen3-0.6b-seed0-v1/`) with transformers' AutoModelForCausalLM in
torch.bfloat16 on the CPU and measures, under torch.inference_mode():

  (a) prefill: one forward pass over a single prompt of --prompt-len tokens (default 512;
      random token ids from the model's vocabulary, fixed --seed), logits kept for the last
      position only (as llama-bench's pp test does). One warm-up pass, then --repeat timed
      passes (default 3); best and median are reported as tokens/s.
  (b) batched decode (skip with --decode-batch 0): a batch of --decode-batch sequences
      (default 16), each with a --decode-context token context (default 128) already in the KV
      cache; the time of ONE forward step of one new token per sequence with that cache
      (past_key_values; `cache` in transformers 5.x).
      The cache is cropped back to the context length before every step, so each step sees the
      same context. One warm-up step, then --repeat timed steps; best and median are reported
      as tokens/s (batch / step time).

It prints one JSON object on stdout (progress goes to stderr) with the tokens/s figures, the
torch and transformers versions, the thread count and whether oneDNN (mkldnn) and its bf16
path are available on this CPU.

Run it with the Python of a virtual environment holding torch, transformers and safetensors
(nothing here is installed by the project):

  /path/to/venv/bin/python scripts/bench-vs-torch.py CHECKPOINT_DIR --threads 2
  /path/to/venv/bin/python scripts/bench-vs-torch.py CHECKPOINT_DIR --threads 2 \\
      --prompt-len 512 --repeat 3 --decode-batch 16 --decode-context 128

--threads defaults to os.cpu_count(). Numbers from a busy machine mean little: run it when
the CPUs are otherwise idle, or alongside the other engines in one session (see
docs/benchmarks.md).
"""

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time


def log(msg):
    print(f"[bench-vs-torch] {msg}", file=sys.stderr, flush=True)


def parse_args():
    p = argparse.ArgumentParser(
        description="Prefill and batched-decode tokens/s of a checkpoint in PyTorch (bf16, CPU).")
    p.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch.set_num_threads (default: os.cpu_count())")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length (default 512)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up (default 3)")
    p.add_argument("--decode-batch", type=int, default=16,
                   help="sequences in the decode batch; 0 skips the decode measurement (default 16)")
    p.add_argument("--decode-context", type=int, default=128,
                   help="tokens already in each sequence's KV cache before the step (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random token ids (default 0)")
    args = p.parse_args()
    if args.threads < 1 or args.prompt_len < 1 or args.repeat < 1:
        p.error("--threads, --prompt-len and --repeat must be >= 1")
    if args.decode_batch < 0 or args.decode_context < 1:
        p.error("--decode-batch must be >= 0 and --decode-context >= 1")
    return args


def onednn_info(torch):
    info = {"mkldnn_available": bool(torch.backends.mkldnn.is_available())}
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        info["mkldnn_bf16_supported"] = bool(probe()) if probe is not None else None
    except Exception as e:  # the op may exist but fail on builds without oneDNN
        info["mkldnn_bf16_supported"] = None
        info["mkldnn_bf16_probe_error"] = repr(e)
    cpu_backend = getattr(torch.backends, "cpu", None)
    if cpu_backend is not None and hasattr(cpu_backend, "get_cpu_capability"):
        info["cpu_capability"] = cpu_backend.get_cpu_capability()
    return info


def summarize(times, tokens):
    best = min(times)
    med = statistics.median(times)
    return {
        "runs_s": [round(t, 6) for t in times],
        "best_s": round(best, 6),
        "median_s": round(med, 6),
        "best_tok_s": round(tokens / best, 3),
        "median_tok_s": round(tokens / med, 3),
    }


def main():
    args = parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)

    # transformers renamed from_pretrained's torch_dtype to dtype (4.56); use whichever it has.
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    log(f"loading {args.checkpoint} in bfloat16 (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {args.threads} threads)")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, **{dtype_kw: torch.bfloat16})
    model.eval()
    load_s = time.perf_counter() - t0
    vocab = int(model.config.vocab_size)

    # Keep only the last position's logits in prefill when the model supports it (llama-bench
    # computes no logits for the rest of the prompt either).
    fwd_params = inspect.signature(model.forward).parameters
    last_only = {}
    if "logits_to_keep" in fwd_params:
        last_only = {"logits_to_keep": 1}
    elif "num_logits_to_keep" in fwd_params:
        last_only = {"num_logits_to_keep": 1}

    # transformers 5.x renames past_key_values (argument and output field) to cache.
    cache_kw = "cache" if "cache" in fwd_params else "past_key_values"

    gen = torch.Generator().manual_seed(args.seed)
    result = {
        "engine": "torch",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "threads": torch.get_num_threads(),
        "checkpoint": os.path.abspath(args.checkpoint),
        "dtype": "bfloat16",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "load_s": round(load_s, 3),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    result.update(onednn_info(torch))

    with torch.inference_mode():
        # (a) prefill of one prompt
        prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=gen, dtype=torch.long)
        log(f"prefill: 1 x {args.prompt_len} tokens, warm-up + {args.repeat} runs")
        model(input_ids=prompt, use_cache=True, **last_only)
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            model(input_ids=prompt, use_cache=True, **last_only)
            times.append(time.perf_counter() - t)
        result["prefill"] = {"batch": 1, "prompt_len": args.prompt_len, "repeat": args.repeat,
                             "logits": "last" if last_only else "all"}
        result["prefill"].update(summarize(times, args.prompt_len))
        log(f"prefill best {result['prefill']['best_tok_s']} tok/s")

        # (b) one decode step of a batch, each sequence with decode_context tokens in the cache
        if args.decode_batch > 0:
            b, ctx = args.decode_batch, args.decode_context
            context = torch.randint(0, vocab, (b, ctx), generator=gen, dtype=torch.long)
            step_ids = torch.randint(0, vocab, (b, 1), generator=gen, dtype=torch.long)
            log(f"decode: batch {b}, context {ctx}: building the KV cache")

            def fresh_cache():
                return getattr(model(input_ids=context, use_cache=True, **last_only), cache_kw)

            def one_step(cache):
                t = time.perf_counter()
                model(input_ids=step_ids, use_cache=True, **{cache_kw: cache})
                return time.perf_counter() - t

            cache = fresh_cache()
            can_crop = hasattr(cache, "crop") and hasattr(cache, "get_seq_length")

            log(f"decode: warm-up + {args.repeat} steps "
                f"({'cropping the cache' if can_crop else 'rebuilding the cache'} between steps)")
            one_step(cache)
            times = []
            for _ in range(args.repeat):
                if can_crop:
                    # A negative argument removes that many tokens (the only form 5.x accepts;
                    # 4.x reads it the same way).
                    extra = cache.get_seq_length() - ctx
                    if extra > 0:
                        cache.crop(-extra)
                    assert cache.get_seq_length() == ctx
                else:
                    cache = fresh_cache()
                times.append(one_step(cache))
            result["decode"] = {"batch": b, "context": ctx, "repeat": args.repeat}
            result["decode"].update(summarize(times, b))
            log(f"decode best {result['decode']['best_tok_s']} tok/s")

    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
