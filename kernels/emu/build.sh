#!/usr/bin/env bash
# Build pd-cuda-emu (kernels/emu/): the CUDA kernel sources of kernels/src/cuda/ compiled as
# C++ for the CPU, with a stand-in CUDA driver and cuBLAS, into OUT_DIR/libpdcudaemu.so, linked
# as OUT_DIR/libcuda.so and OUT_DIR/libcublas.so, and its self-test OUT_DIR/selftest. With
# OUT_DIR first on LD_LIBRARY_PATH (and a real libnvrtc after it), cudarc finds these and
# pd-kernels' CUDA backend runs on the CPU. A test tool only (scripts/cuda-check.sh); no
# product binary loads it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: kernels/emu/build.sh OUT_DIR}"
mkdir -p "$out/src"
cxx="${CXX:-g++}"

# One translation unit per kernel source (each starts with common.cuh, as under NVRTC; the
# headers it includes, sample.cuh, are found by -I),
# registering every `extern "C" __global__` function with its __launch_bounds__.
python3 - "$here" "$out/src" <<'PY'
import pathlib, re, sys
here, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
cuda = here.parent / "src" / "cuda"
kernel = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(([^)]*)\)\s*)?(\w+)\s*\(')
for cu in sorted(cuda.glob("*.cu")):
    text = cu.read_text()
    found = kernel.findall(text)
    if not found:
        sys.exit(f"{cu}: no kernels found")
    # `extern __shared__` (dynamic shared memory) names the emulator's one `smem` array;
    # other `__shared__` arrays become statics (emu.h).
    text = text.replace("extern __shared__", "extern")
    lines = [
        "#define PD_CUDA_EMU 1",
        f'#include "{here}/runtime.h"',
        f'#line 1 "common.cuh"',
        f'#include "{cuda}/common.cuh"',
        f'#line 1 "{cu.name}"',
        text,
    ]
    # __launch_bounds__(max threads[, min blocks]): the emulator checks the first.
    lines += [f"EMU_KERNEL({name}, ({bounds.split(',')[0] or 0}))" for bounds, name in found]
    (out / f"{cu.stem}.cpp").write_text("\n".join(lines) + "\n")
PY

flags=(-O3 -g1 -std=c++20 -fPIC -fvisibility=hidden -ffp-contract=off -pthread
       -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -I"$here" -I"$here/../src/cuda")
objs=()
for src in "$here/runtime.cpp" "$here/driver.cpp" "$here/cublas.cpp" "$out"/src/*.cpp; do
    obj="$out/src/$(basename "${src%.cpp}").o"
    "$cxx" "${flags[@]}" -c "$src" -o "$obj"
    objs+=("$obj")
done
"$cxx" -shared -pthread -Wl,--no-undefined -o "$out/libpdcudaemu.so" "${objs[@]}"
# The emulator's own test (selftest.cpp), linked with the same objects.
"$cxx" "${flags[@]}" -c "$here/selftest.cpp" -o "$out/src/selftest.o"
"$cxx" -pthread -o "$out/selftest" "$out/src/selftest.o" "${objs[@]}"
ln -sf libpdcudaemu.so "$out/libcuda.so"
ln -sf libpdcudaemu.so "$out/libcublas.so"
echo "pd-cuda-emu: $out/libcuda.so, $out/libcublas.so"
