#!/usr/bin/env bash
# Drive live local clusters with third-party clients: Python grpcio with stubs generated
# from proto/, and the official `openai` package against the OpenAI-compatible HTTP API; then
# the same clients against a router with API keys (refused without the key, served with it),
# and against a `pdctl up --secure` cluster over TLS (trusting its CA; plaintext refused).
# Needs the workspace binaries built (target/debug).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    openai==3.60.0 >/dev/null
cache="$(mktemp -d)"
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p" 2>/dev/null || true; done; rm -rf "$cache"' EXIT

# up NAME [VAR=VALUE]... [-- PDCTL-UP FLAGS]: a `pdctl up` cluster whose ready line lands in
# $cache/NAME.json.
up() {
    local name=$1
    shift
    local vars=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    env "${vars[@]}" PD_CACHE_DIR="$cache" RUST_LOG=warn ./target/debug/pdctl up --model synthetic:tiny "$@" \
        >"$cache/$name.json" &
    pids+=($!)
    for _ in $(seq 1 600); do
        [ -s "$cache/$name.json" ] && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || { echo "pdctl up ($name) exited before it was ready" >&2; exit 1; }
        sleep 0.2
    done
    echo "pdctl up ($name) was not ready in time" >&2
    exit 1
}
key() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$cache/$1.json" "$2"; }

up open PD_TOOL_CALL_PARSER=hermes
api_key="python-client-key-$RANDOM$RANDOM"
printf '# tenant key\npython %s\n' "$api_key" >"$cache/api-keys"
up keyed PD_API_KEYS_FILE="$cache/api-keys"
up secure -- --secure

failed=0
python3 tests/python/client_test.py "$(key open router)" || failed=1
python3 tests/python/openai_client_test.py "$(key open openai)" || failed=1
python3 tests/python/auth_client_test.py "$(key keyed router)" "$(key keyed openai)" "$api_key" || failed=1
python3 tests/python/auth_client_test.py "$(key secure router)" "$(key secure openai)" \
    "$(key secure api_key)" "$(key secure ca)" || failed=1
exit $failed
