#!/usr/bin/env bash
# RDMA checks (docs/transport.md, "Operator check").
#
#   scripts/rdma-check.sh                   any machine, no RDMA hardware needed: installs the
#                                           build dependencies, builds and tests the `rdma`
#                                           feature, checks the no-device start refusal
#   scripts/rdma-check.sh --fabric serve    host A (RDMA NIC, perftest installed)
#   scripts/rdma-check.sh --fabric HOST_A   host B: ib_read_bw against A as the ceiling, then
#                                           the project's RDMA transfer benchmark with the same
#                                           operation sizes; prints our share of ib_read_bw
#
# On a host with an RDMA device (real, or Soft-RoCE: `rdma link add rxe0 type rxe netdev
# eth0`), PD_TEST_RDMA_DEVICE=rxe0 makes the first form also run the tests over RDMA: a
# prefill/decode pair (decode-node/tests/rdma.rs) and the keystone through `pdctl up
# --kv-transport rdma` (tests/tests/rdma.rs).
#
# Environment: RDMA_DEVICE (e.g. mlx5_0), RDMA_GID_INDEX (RoCE), SIZES (operation sizes in
# bytes, default "65536 1048576 4194304"), ITERS (default 20 benchmark reads of the lease),
# BENCH_PORT (default 18600). The builds use their own target directory (target/rdma-check)
# so that they never replace the default build's binaries; scripts/test.sh runs this last and
# sets RDMA_TARGET_DIR=target to share the dependencies already built there.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="${RDMA_TARGET_DIR:-target/rdma-check}"
SIZES="${SIZES:-65536 1048576 4194304}"
ITERS="${ITERS:-20}"
BENCH_PORT="${BENCH_PORT:-18600}"
# bindgen picks the newest libclang; where its headers are missing it fails on stddef.h.
export LIBCLANG_PATH="${LIBCLANG_PATH:-/usr/lib/llvm-14/lib}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_deps() {
    # cmake and libclang build rdma-core's headers and loader stub (rdma-mummy-sys); neither
    # libibverbs-dev nor Debian's rdma-core package (udev, a systemd upgrade) is needed.
    local pkgs=(cmake libclang1-14 libclang-common-14-dev)
    if dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
        return
    fi
    echo "== installing the build dependencies: ${pkgs[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
}

# The tests that need the device PD_TEST_RDMA_DEVICE names (#[ignore]d elsewhere, so run
# with --ignored): a prefill/decode pair, then the keystone through
# `pdctl up --kv-transport rdma` with 1 + 1 and 2 + 2 nodes.
device_tests() {
    echo "== over RDMA on $PD_TEST_RDMA_DEVICE: a prefill/decode pair"
    cargo test --locked --target-dir "$TARGET" -p decode-node --features rdma --test rdma -- --ignored
    echo "== over RDMA on $PD_TEST_RDMA_DEVICE: the keystone through pdctl up"
    # The keystone starts the binaries next to its own test executable: all of them, the
    # node binaries built with the feature (last, so that they are the ones left there).
    cargo build --locked --target-dir "$TARGET" --workspace --bins
    cargo build --locked --target-dir "$TARGET" -p prefill-node -p decode-node --features rdma
    cargo test --locked --target-dir "$TARGET" -p pd-tests --test rdma -- --ignored
}

build_check() {
    install_deps
    echo "== unit tests and proptests with the rdma feature"
    cargo test --locked --target-dir "$TARGET" -p pd-transport --features rdma
    cargo test --locked --target-dir "$TARGET" -p pd-node --features rdma --lib kv_transport
    echo "== node binaries and the benchmark with the rdma feature"
    cargo build --locked --target-dir "$TARGET" -p prefill-node -p decode-node --features rdma
    cargo build --locked --target-dir "$TARGET" -p pd-transport --features rdma --example rdma_bench
    echo "== lints and docs with the rdma feature (the workspace's own pass builds without it)"
    cargo clippy --locked --target-dir "$TARGET" -p pd-transport -p pd-node -p prefill-node \
        -p decode-node --features pd-transport/rdma,pd-node/rdma,prefill-node/rdma,decode-node/rdma \
        --all-targets -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc --locked --target-dir "$TARGET" --no-deps \
        -p pd-transport -p pd-node --features pd-transport/rdma,pd-node/rdma
    for bin in prefill-node decode-node; do
        if ldd "$TARGET/debug/$bin" | grep -q libibverbs; then
            echo "FAIL: $bin links libibverbs; it must load it at run time" >&2
            exit 1
        fi
    done
    echo "ok: the rdma binaries do not link libibverbs"
    if compgen -G "/sys/class/infiniband/*" >/dev/null; then
        echo "== this host has an RDMA device: the no-device checks do not apply"
        if [ -n "${PD_TEST_RDMA_DEVICE:-}" ]; then
            device_tests
        else
            echo "   (set PD_TEST_RDMA_DEVICE to one of: $(ls /sys/class/infiniband | tr '\n' ' ')to run the tests over RDMA)"
        fi
        return
    fi
    echo "== --kv-transport rdma on a host without a device: one line, non-zero exit"
    for bin in prefill-node decode-node; do
        set +e
        err=$(env -u RUST_LOG "$TARGET/debug/$bin" --kv-transport rdma 2>&1 >/dev/null)
        rc=$?
        set -e
        if [ "$rc" = 0 ] || [ "$(printf '%s\n' "$err" | grep -c .)" != 1 ] \
            || [[ "$err" != "error: --kv-transport rdma found no usable RDMA device"* ]] \
            || [[ "$err" != *"--kv-transport auto or tcp" ]]; then
            echo "FAIL: $bin exited $rc with: $err" >&2
            exit 1
        fi
        echo "ok: $bin exits $rc: $err"
    done
    echo "== --kv-transport auto on a host without a device: serves over TCP"
    local out cache
    out=$(mktemp)
    cache=$(mktemp -d)
    PD_CACHE_DIR="$cache" env -u RUST_LOG "$TARGET/debug/decode-node" --kv-transport auto >"$out" 2>/dev/null &
    local pid=$!
    for _ in $(seq 1 240); do
        if [ -s "$out" ] || ! kill -0 "$pid" 2>/dev/null; then break; fi
        sleep 0.5
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    if ! grep -q '"grpc"' "$out"; then
        echo "FAIL: decode-node --kv-transport auto did not become ready: $(cat "$out")" >&2
        exit 1
    fi
    echo "ok: decode-node --kv-transport auto became ready: $(head -c 200 "$out")"
    rm -rf "$out" "$cache"
    echo "rdma-check: all build and no-device checks passed (the RDMA data path needs a fabric: --fabric)"
}

perftest_flags() {
    local f=()
    [ -n "${RDMA_DEVICE:-}" ] && f+=(-d "$RDMA_DEVICE")
    [ -n "${RDMA_GID_INDEX:-}" ] && f+=(-x "$RDMA_GID_INDEX")
    echo "${f[@]}"
}

bench_flags() {
    local f=()
    [ -n "${RDMA_DEVICE:-}" ] && f+=(--device "$RDMA_DEVICE")
    [ -n "${RDMA_GID_INDEX:-}" ] && f+=(--gid-index "$RDMA_GID_INDEX")
    echo "${f[@]}"
}

build_bench() {
    install_deps
    command -v ib_read_bw >/dev/null || { echo "ib_read_bw not found: install perftest" >&2; exit 1; }
    cargo build --release --locked --target-dir "$TARGET" -p pd-transport --features rdma --example rdma_bench
}

fabric_serve() {
    build_bench
    for size in $SIZES; do
        echo "== ib_read_bw server, $size-byte READs (waiting for the client)"
        # shellcheck disable=SC2046
        ib_read_bw $(perftest_flags) -s "$size" -n 2000 --report_gbits >/dev/null
    done
    local ip
    ip=$(hostname -I | awk '{print $1}')
    echo "== benchmark server on port $BENCH_PORT (Ctrl-C to stop)"
    # shellcheck disable=SC2046
    exec "$TARGET/release/examples/rdma_bench" serve --listen "0.0.0.0:$BENCH_PORT" \
        --advertise "$ip:$BENCH_PORT" $(bench_flags)
}

fabric_read() {
    local host=$1
    build_bench
    declare -A ceiling
    for size in $SIZES; do
        sleep 2
        # shellcheck disable=SC2046
        line=$(ib_read_bw $(perftest_flags) -s "$size" -n 2000 --report_gbits "$host" \
            | awk -v s="$size" '$1 == s {print $4}')
        ceiling[$size]=$line
        echo "ib_read_bw $size B: ${line} Gbit/s"
    done
    sleep 5
    # shellcheck disable=SC2046
    results=$("$TARGET/release/examples/rdma_bench" read --peer "$host:$BENCH_PORT" \
        --sizes "$(echo "$SIZES" | tr ' ' ,)" --iters "$ITERS" $(bench_flags))
    echo
    printf '%-10s %-18s %-18s %s\n' "op bytes" "ib_read_bw Gbit/s" "pd-transport Gbit/s" "fraction"
    local missed=0
    while read -r json; do
        size=$(sed -E 's/.*"size": ([0-9]+).*/\1/' <<<"$json")
        ours=$(sed -E 's/.*"gbit_per_s": ([0-9.]+).*/\1/' <<<"$json")
        frac=$(awk -v a="$ours" -v b="${ceiling[$size]}" 'BEGIN {printf "%.3f", (b > 0 ? a / b : 0)}')
        printf '%-10s %-18s %-18s %s\n' "$size" "${ceiling[$size]}" "$ours" "$frac"
        if [ "$size" -ge 1048576 ] && awk -v f="$frac" 'BEGIN {exit !(f < 0.9)}'; then
            missed=1
        fi
    done <<<"$results"
    if [ "$missed" = 1 ]; then
        echo "goal missed: below 90 % of ib_read_bw at 1 MiB or more per operation" >&2
        exit 1
    fi
    echo "goal met: at least 90 % of ib_read_bw at 1 MiB or more per operation"
}

case "${1:-}" in
    "") build_check ;;
    --fabric)
        [ -n "${2:-}" ] || { echo "usage: $0 --fabric serve|HOST" >&2; exit 2; }
        if [ "$2" = serve ]; then fabric_serve; else fabric_read "$2"; fi
        ;;
    *) echo "usage: $0 [--fabric serve|HOST]" >&2; exit 2 ;;
esac
