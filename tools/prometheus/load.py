"""Drive a live router with a mixed load for the Prometheus check (scripts/prometheus-check.sh).

Usage: python3 tools/prometheus/load.py ROUTER_ADDR [--requests N] [--concurrency C]

What the dashboard and rules need to have data for, through the real client API (Python
grpcio, stubs generated from proto/ as tests/python/client_test.py does):
- prompts sharing long prefixes, so prefix-cache queries and hits (local, and external from
  the host tier when the KV pool is small) grow;
- concurrent streams with several tokens each, so TTFT, inter-token latency, in-flight and
  running series move;
- a client-side abort (outcome "abort") and a bad request (outcome "invalid_argument").
Prints a one-line JSON summary (requests by outcome, cached tokens) and exits non-zero if a
request that should succeed fails.
"""

import argparse
import json
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from client_test import generate_stubs  # noqa: E402

# Eight long prefixes (about ten KV blocks each), each opening with its own words so that no
# two share a block. Every other request uses the first (hot: it stays in the device tier, a
# local hit); the others cycle through the rest, more than a small KV pool holds: with
# `--num-gpu-blocks` small and `--host-cache-blocks` on, they are evicted to the host tier and
# restored from it (external hits).
TOPICS = ["Logistics", "Support", "Finance", "Weather", "Chemistry", "Travel", "Music", "Law"]
PREFIXES = [
    f"{topic} desk, briefing {k}. You are a careful assistant for the {topic.lower()} team. "
    "Answer briefly, cite the relevant section, list open questions as bullet points, then "
    "suggest the next action for the person on duty, keeping a polite and neutral tone. " * 3
    for k, topic in enumerate(TOPICS)
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("router")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()

    generate_stubs(tempfile.mkdtemp())
    from pd.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

    channel = grpc.insecure_channel(args.router)
    stub = generation_pb2_grpc.GenerationStub(channel)
    greedy = common_pb2.SamplingParams(temperature=0.0)
    lock = threading.Lock()
    outcomes = {}
    cached = {"local": 0, "external": 0, "prompt": 0}
    failures = []

    def count(outcome):
        with lock:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    def one(i):
        prefix = PREFIXES[0] if i % 2 == 0 else PREFIXES[1 + (i // 2) % (len(PREFIXES) - 1)]
        prompt = prefix + f"Question {i}: what changes for order {i * 7}?"
        req = generation_pb2.GenerateRequest(
            text=prompt, sampling=greedy, max_tokens=args.max_tokens, ignore_eos=True
        )
        try:
            last = None
            for chunk in stub.Generate(req, timeout=120):
                last = chunk
            reason = common_pb2.FinishReason.Name(last.finish_reason)
            count(reason.removeprefix("FINISH_REASON_").lower())
            with lock:
                cached["local"] += last.usage.local_cached_tokens
                cached["external"] += last.usage.external_cached_tokens
                cached["prompt"] += last.usage.prompt_tokens
        except grpc.RpcError as e:
            count(e.code().name.lower())
            with lock:
                failures.append(f"request {i}: {e.code().name}: {e.details()}")

    def aborted():
        rid = "prometheus-check-abort"
        req = generation_pb2.GenerateRequest(
            text=PREFIXES[0] + "Write a very long essay.",
            sampling=greedy,
            # Long enough to be aborted mid-stream, short enough to fit a small KV pool.
            max_tokens=400,
            ignore_eos=True,
            request_id=rid,
        )
        stream = stub.Generate(req, timeout=120)
        next(stream)
        if not stub.Abort(generation_pb2.AbortRequest(request_id=rid)).aborted:
            with lock:
                failures.append("the abort request found nothing to abort")
        try:
            for _ in stream:
                pass
            count("abort")
        except grpc.RpcError as e:
            count(e.code().name.lower())

    def invalid():
        try:
            list(stub.Generate(generation_pb2.GenerateRequest(text="", max_tokens=4), timeout=30))
            failures.append("an empty prompt was accepted")
        except grpc.RpcError as e:
            count(e.code().name.lower())
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                failures.append(f"empty prompt: {e.code().name}, not INVALID_ARGUMENT")

    with ThreadPoolExecutor(args.concurrency) as pool:
        jobs = [pool.submit(one, i) for i in range(args.requests)]
        jobs += [pool.submit(aborted), pool.submit(invalid)]
        for j in jobs:
            j.result()

    print(json.dumps({"outcomes": outcomes, "usage": cached}))
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
