#!/usr/bin/env bash
# Chaos soak: a secure local cluster (2 prefill + 2 decode nodes, mTLS, API key) under steady
# load with a mix of prompts, choices, aborts, client disconnects and short deadlines; a random
# node is SIGKILLed every few seconds and restarted, the router once. At the end it checks that
# no client waited past its deadline, every stream ended with its tokens or a clear error, no
# node holds a KV block or lease, the router's counters equal the nodes' own over all their
# processes, and resident memory stayed flat over the second half of each process's life.
#
#   scripts/soak.sh [MINUTES] [SOAK FLAGS...]     (default 3 minutes; --help for the flags)
#
# Builds the workspace binaries (debug profile, as the test suite does) unless
# PD_SOAK_NO_BUILD=1; PD_SOAK_PROFILE=release builds and soaks the release binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-3}"
[ $# -gt 0 ] && shift
profile="${PD_SOAK_PROFILE:-debug}"
if [ "${PD_SOAK_NO_BUILD:-0}" != 1 ]; then
    if [ "$profile" = release ]; then
        cargo build --release --workspace --bins --locked
    else
        cargo build --workspace --bins --locked
    fi
fi
RUST_LOG="${RUST_LOG:-warn}" exec "./target/$profile/soak" --minutes "$minutes" "$@"
