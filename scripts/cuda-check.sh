#!/usr/bin/env bash
# CI for the CUDA backend on a machine without a GPU (called by scripts/test.sh):
# 1. build pd-kernels, the node binaries and pdctl with the `cuda` feature (cudarc loads the
#    CUDA libraries at run time, so no CUDA install is needed to build);
# 2. run pd-kernels' tests with the feature (launch planning, the "no driver" sentence; the
#    GPU conformance suite skips itself without PD_GPU_TESTS=1);
# 3. compile EVERY kernel source with NVRTC, with the exact options the backend uses at
#    start-up, for sm_80 and sm_90 (examples/nvrtc_check.rs), and assemble each PTX with
#    ptxas, failing on any error and printing registers / spills per kernel.
# NVRTC and ptxas come from PyPI (CUDA 13.0, the version of the GPU test host's driver).
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=13.0.88
NVCC_VERSION=13.0.88
venv="${PD_CUDA_VENV:-${TMPDIR:-/tmp}/pd-cuda-tools-$NVRTC_VERSION}"

echo "== CUDA tools from PyPI (nvidia-cuda-nvrtc $NVRTC_VERSION, nvidia-cuda-nvcc $NVCC_VERSION)"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nvidia-cuda-nvrtc==$NVRTC_VERSION" "nvidia-cuda-nvcc==$NVCC_VERSION"
cuda_dir="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')"
ptxas="$cuda_dir/bin/ptxas"
test -x "$ptxas" || { echo "ptxas not found under $cuda_dir" >&2; exit 1; }

echo "== build with the cuda feature"
cargo build --locked -p pd-kernels --features cuda --example nvrtc_check
cargo build --locked -p prefill-node -p decode-node -p pdctl --features cuda

echo "== pd-kernels tests with the cuda feature"
cargo test --locked -p pd-kernels --features cuda

echo "== NVRTC: every kernel source for sm_80 and sm_90"
ptx_dir="$(mktemp -d)"
trap 'rm -rf "$ptx_dir"' EXIT
LD_LIBRARY_PATH="$cuda_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    target/debug/examples/nvrtc_check "$ptx_dir" sm_80 sm_90

echo "== ptxas: assemble each PTX (registers, spills per kernel)"
status=0
for ptx in "$ptx_dir"/*.ptx; do
    arch="${ptx%.ptx}"
    arch="${arch##*.}"
    if ! report="$("$ptxas" -arch="$arch" -v "$ptx" -o /dev/null 2>&1)"; then
        echo "ptxas FAILED on $(basename "$ptx"):" >&2
        echo "$report" >&2
        status=1
        continue
    fi
    # One line per kernel: name, arch, registers, stack, spills, shared memory.
    echo "$report" | awk -v file="$(basename "$ptx")" '
        /Compiling entry function/ { name = $7; gsub(/\047/, "", name) }
        /bytes stack frame/ { stack = $1; spill_st = $5; spill_ld = $9 }
        /Used [0-9]+ registers/ {
            regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
            smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
            printf "  %-24s %-18s regs %3s  stack %3s B  spills %s/%s B  smem %s B\n", file, name, regs, stack, spill_st, spill_ld, smem
        }'
    if echo "$report" | grep -qE '[1-9][0-9]* bytes spill (stores|loads)'; then
        echo "  note: $(basename "$ptx") spills registers (see above)"
    fi
done
exit "$status"
