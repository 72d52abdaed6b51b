#!/usr/bin/env bash
# CI for the CUDA backend on a machine without a GPU (called by scripts/test.sh):
# 1. build pd-kernels, the node binaries and pdctl with the `cuda` feature (cudarc loads the
#    CUDA libraries at run time, so no CUDA install is needed to build);
# 2. run pd-kernels' tests with the feature (launch planning, the "no driver" sentence; the
#    GPU conformance suite is #[ignore]d there: it needs a CUDA device);
# 3. compile EVERY kernel source with NVRTC, with the exact options the backend uses at
#    start-up, for sm_80 and sm_90 (examples/nvrtc_check.rs), and assemble each PTX with
#    ptxas, failing on any error and printing registers / spills per kernel;
# 4. run the CUDA backend itself on pd-cuda-emu (kernels/emu/: the kernel sources compiled as
#    C++ for the CPU behind a stand-in libcuda / libcublas, with the real NVRTC): the GPU
#    conformance suite against the CPU backend, once more with the threads of each block
#    and the blocks scheduled in reverse (a missing __syncthreads changes the result; another
#    split-K split does the merge), and the GPU
#    benchmark at smoke sizes, so that scripts/gpu-check.sh has run end to end before a GPU
#    host runs it; the start-up refusals (old device, missing device, too little memory);
#    then the cluster keystone with both nodes on `--device cuda` (tests/tests/cuda.rs).
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

echo "== lints and docs with the cuda feature (the workspace's own pass builds without it)"
cuda_features=pd-kernels/cuda,prefill-node/cuda,decode-node/cuda,pdctl/cuda
cargo clippy --locked -p pd-kernels -p prefill-node -p decode-node -p pdctl \
    --features "$cuda_features" --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps -p pd-kernels --features cuda

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
[ "$status" -eq 0 ] || exit "$status"

echo "== pd-cuda-emu: the CUDA backend with its kernels run on the CPU (no GPU; docs/cuda.md)"
emu_dir="$PWD/target/cuda-emu"
if ! command -v "${CXX:-g++}" >/dev/null; then
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++
fi
kernels/emu/build.sh "$emu_dir"
echo "-- the emulator's own test (warp ops, barriers, indices, f16, mma; a divergent barrier stops it)"
"$emu_dir/selftest"
PD_CUDA_EMU_SCHEDULE=reverse "$emu_dir/selftest"
conformance="$(cargo test --locked -p pd-kernels --features cuda --test gpu_conformance \
    --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*gpu_conformance[^"]*\)".*/\1/p' | tail -1)"
test -n "$conformance" || { echo "no gpu_conformance test binary" >&2; exit 1; }
cargo build --locked -p pd-kernels --features cuda --example gpu_bench
emu() {
    LD_LIBRARY_PATH="$emu_dir:$cuda_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}
echo "-- conformance, CUDA (emulated) vs CPU"
emu "$conformance" --ignored --test-threads=1
echo "-- conformance on the tiny model, each block's threads and the blocks scheduled in reverse"
emu env PD_CUDA_EMU_SCHEDULE=reverse "$conformance" --ignored --test-threads=1 tiny
echo "-- gpu_bench at smoke sizes (the figures mean nothing here: it runs the code path)"
bench_out="$(mktemp -d)"
emu env PD_GPU_BENCH_SMOKE=1 target/debug/examples/gpu_bench "$bench_out" synthetic:tiny
test -s "$bench_out/gpu_bench.json" || { echo "gpu_bench wrote no gpu_bench.json" >&2; exit 1; }
test -s "$bench_out/table.txt" || { echo "gpu_bench wrote no table.txt" >&2; exit 1; }
# The step gpu-check.sh profiles with Nsight Compute (no profiler attaches here).
profiled="$(emu env PD_GPU_BENCH_SMOKE=1 target/debug/examples/gpu_bench --profile-decode synthetic:tiny kernel)"
echo "$profiled"
case "$profiled" in
*"kernel launches"*"per step"*) ;;
*) echo "gpu_bench --profile-decode printed no launch count" >&2; exit 1 ;;
esac
rm -rf "$bench_out"
echo "-- refusals at start, each one sentence (pdctl run and prefill-node on --device cuda)"
refused() { # refused "what it must say" COMMAND...: COMMAND fails and says it
    local want="$1" out
    shift
    if out="$("$@" 2>&1)"; then
        echo "started, but should have refused: $*" >&2
        exit 1
    fi
    grep -qF -- "$want" <<<"$out" || { echo "$*: expected \"$want\" in:" >&2; echo "$out" >&2; exit 1; }
    echo "  $(grep -F -- "$want" <<<"$out" | head -1)"
}
cargo build --locked -p prefill-node -p pdctl --features cuda
refused "compute capability 7.5, but the CUDA backend needs 8.0" \
    emu env PD_CUDA_EMU_CC=7.5 target/debug/pdctl run --device cuda --prompt hi --model synthetic:tiny
refused "compute capability 7.0, but the CUDA backend needs 8.0" \
    emu env PD_CUDA_EMU_CC=7.0 target/debug/prefill-node --device cuda --model synthetic:tiny --port 0
refused "this machine has 1 CUDA device(s)" \
    emu target/debug/pdctl run --device cuda:1 --prompt hi --model synthetic:tiny
refused "raise --gpu-memory-utilization or use a smaller model" \
    emu env PD_CUDA_EMU_MEMORY_MIB=1024 target/debug/prefill-node --device cuda --model synthetic:tiny --port 0
refused "PD_CUDA_ATTENTION=tensor: expected auto" \
    emu env PD_CUDA_ATTENTION=tensor target/debug/pdctl run --device cuda --prompt hi --model synthetic:tiny
refused "PD_CUDA_GEMV=fast: expected cublas or kernel" \
    emu env PD_CUDA_GEMV=fast target/debug/prefill-node --device cuda --model synthetic:tiny --port 0
refused "PD_CUDA_PDL=yes: expected on or off" \
    emu env PD_CUDA_PDL=yes target/debug/pdctl run --device cuda --prompt hi --model synthetic:tiny
refused "PD_CUDA_MOE=gpu: expected device or host" \
    emu env PD_CUDA_MOE=gpu target/debug/prefill-node --device cuda --model synthetic:tiny --port 0
echo "-- the keystone on CUDA nodes (router -> prefill -> decode, --device cuda, CUDA graphs on)"
keystone="$(cargo test --locked --workspace --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*\/cuda-[0-9a-f]*\)".*/\1/p' | tail -1)"
test -n "$keystone" || { echo "no pd-tests cuda test binary" >&2; exit 1; }
# Building the workspace's tests rebuilt the node binaries without the feature: again with it.
cargo build --locked -p prefill-node -p decode-node -p pdctl --features cuda
# 2 GiB of emulated device memory per node process: the KV cache is sized from it.
emu env PD_CUDA_EMU_MEMORY_MIB=2048 "$keystone" --ignored
