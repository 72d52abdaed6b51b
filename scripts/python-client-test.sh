#!/usr/bin/env bash
# Drive a live local cluster with a third-party client: Python grpcio with stubs generated
# from proto/. Needs the workspace binaries built (target/debug).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 >/dev/null
cache="$(mktemp -d)"
ready="$cache/ready.json"
PD_CACHE_DIR="$cache" RUST_LOG=warn ./target/debug/pdctl up --model synthetic:tiny >"$ready" &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true; rm -rf "$cache"' EXIT
for _ in $(seq 1 600); do
    [ -s "$ready" ] && break
    kill -0 $up 2>/dev/null || { echo "pdctl up exited before it was ready" >&2; exit 1; }
    sleep 0.2
done
router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$ready")
python3 tests/python/client_test.py "$router"
