#!/usr/bin/env bash
# Drive a live local cluster with third-party clients: Python grpcio with stubs generated
# from proto/, and the official `openai` package against the OpenAI-compatible HTTP API.
# Needs the workspace binaries built (target/debug).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    openai==3.60.0 >/dev/null
cache="$(mktemp -d)"
ready="$cache/ready.json"
PD_CACHE_DIR="$cache" PD_TOOL_CALL_PARSER=hermes RUST_LOG=warn ./target/debug/pdctl up --model synthetic:tiny >"$ready" &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true; rm -rf "$cache"' EXIT
for _ in $(seq 1 600); do
    [ -s "$ready" ] && break
    kill -0 $up 2>/dev/null || { echo "pdctl up exited before it was ready" >&2; exit 1; }
    sleep 0.2
done
key() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$ready" "$1"; }
router=$(key router)
openai=$(key openai)
failed=0
python3 tests/python/client_test.py "$router" || failed=1
python3 tests/python/openai_client_test.py "$openai" || failed=1
exit $failed
