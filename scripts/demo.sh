#!/usr/bin/env bash
# The main job: build, start a local PD cluster (router + 1 prefill + 1 decode node) on the
# embedded default model, send it real requests, stop it. MODEL=synthetic:qwen3-0.6b for the
# real Qwen3-0.6B shape (1.2 GB of weights written once).
set -euo pipefail
cd "$(dirname "$0")/.."
model="${MODEL:-synthetic:tiny}"
cargo build --release --workspace --bins
dir="$(mktemp -d)"
./target/release/pdctl up --model "$model" >"$dir/ready.json" &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 1 3000); do
    [ -s "$dir/ready.json" ] && break
    kill -0 $up 2>/dev/null || { echo "pdctl up failed" >&2; exit 1; }
    sleep 0.2
done
echo "cluster: $(cat "$dir/ready.json")"
router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$dir/ready.json")
gen() { ./target/release/pdctl generate --router "$router" "$@"; }
echo "--- chat, streamed"
gen --chat "Write a haiku about caches" --max-tokens 32
prompt="$(printf 'A shared system prompt that many requests start with. %.0s' 1 2 3 4 5 6)"
echo "--- the same long prompt twice: the second reuses the prefill node's cache"
gen --prompt "$prompt Question one?" --max-tokens 8 --json
gen --prompt "$prompt Question two?" --max-tokens 8 --json
echo "--- the same cluster through its OpenAI-compatible HTTP API (docs/openai.md)"
openai=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["openai"])' "$dir/ready.json")
python3 - "$openai" <<'PY'
import json, sys, urllib.request
body = {"messages": [{"role": "user", "content": "Write a haiku about caches"}],
        "max_tokens": 16, "n": 2, "seed": 7}
req = urllib.request.Request(sys.argv[1] + "/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req))
for c in r["choices"]:
    print(f"choice {c['index']} ({c['finish_reason']}): {c['message']['content']!r}")
print("usage:", json.dumps(r["usage"]))
PY
echo "--- what the router's /metrics says now (pd_router_*: local vs external hits per node and role)"
# The router applies the nodes' counter reports as they arrive (on responses and its 0.5 s
# Info polls); give the last one a moment.
sleep 1
router_metrics=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router_metrics"])' "$dir/ready.json")
./target/release/pdctl metrics --router-metrics "$router_metrics" --once
