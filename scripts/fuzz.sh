#!/usr/bin/env bash
# Fuzzes the parts that read untrusted input (docs/fuzzing.md): builds the cargo-fuzz targets
# of fuzz/ and runs each for SECONDS (default 60) from its seed corpus (fuzz/corpus/<target>)
# and dictionary (fuzz/dict/<target>.dict, where there is one). Exits non-zero if a target
# crashed, failed a property, timed out (20 s for one input) or ran out of memory, printing
# the reproducer's path. Installs what it needs: cargo-fuzz (pinned, into target/tools), and a
# nightly toolchain through rustup where one can be had, else runs the default toolchain
# with RUSTC_BOOTSTRAP=1.
#
#   scripts/fuzz.sh [SECONDS]           every target
#   FUZZ_TARGETS="kv_wire tokenizer" scripts/fuzz.sh 30
#
# Environment: FUZZ_TARGETS (default: all), FUZZ_TOOLCHAIN (default nightly),
# FUZZ_SANITIZER (address, the default, or none: faster, for safe Rust the assertions and
# overflow checks are what find bugs), FUZZ_PROFILE (release, the default, or dev:
# dependencies unoptimised, a build about 4x faster of code that runs several times slower,
# for short runs such as CI's).
# Inputs a run finds go to target/fuzz/corpus/<target>, crashes to target/fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
cargo_fuzz_version=0.13.1
all_targets=(kv_wire generate_request openai_body json_schema gbnf_grammar chat_template tokenizer)
read -r -a targets <<<"${FUZZ_TARGETS:-${all_targets[*]}}"
sanitizer="${FUZZ_SANITIZER:-address}"
profile="${FUZZ_PROFILE:-release}"
target_dir="$PWD/target/fuzz"

# cargo-fuzz, pinned, cached in target/tools.
tools="$PWD/target/tools"
if ! "$tools/bin/cargo-fuzz" --version 2>/dev/null | grep -qF " $cargo_fuzz_version"; then
    echo "fuzz: installing cargo-fuzz $cargo_fuzz_version into $tools"
    cargo install --quiet --locked --root "$tools" cargo-fuzz --version "$cargo_fuzz_version"
fi
export PATH="$tools/bin:$PATH"

# libFuzzer's instrumentation needs unstable compiler flags: a nightly toolchain where rustup
# has or can fetch one, else the default (stable) toolchain told to accept them.
toolchain="${FUZZ_TOOLCHAIN:-nightly}"
if rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
    plus=("+$toolchain")
elif timeout 300 rustup toolchain install "$toolchain" --profile minimal >/dev/null 2>&1; then
    plus=("+$toolchain")
else
    echo "fuzz: no $toolchain toolchain; using $(rustc --version) with RUSTC_BOOTSTRAP=1"
    export RUSTC_BOOTSTRAP=1
    plus=()
fi
# A toolchain named here that is no nightly (FUZZ_TOOLCHAIN=stable) needs the same permission.
if ! rustc "${plus[@]}" --version | grep -q nightly; then
    export RUSTC_BOOTSTRAP=1
fi
echo "fuzz: $(rustc "${plus[@]}" --version), cargo-fuzz $cargo_fuzz_version, sanitizer $sanitizer, profile ${FUZZ_PROFILE:-release}"

common=(--sanitizer "$sanitizer" --debug-assertions --target-dir "$target_dir")
out_dir=release
if [[ "$profile" == dev ]]; then
    common+=(--dev)
    out_dir=debug
fi
start=$(date +%s)
mkdir -p "$target_dir"
if ! cargo "${plus[@]}" fuzz build "${common[@]}" >"$target_dir/build.log" 2>&1; then
    tail -n 60 "$target_dir/build.log" >&2
    echo "fuzz: the build failed (log: $target_dir/build.log)" >&2
    exit 1
fi
echo "fuzz: built in $(($(date +%s) - start)) s"

# One target for $seconds: a working corpus in target/ (the committed seeds stay as they are).
run() {
    local t="$1" corpus="$target_dir/corpus/$1" artifacts="$target_dir/artifacts/$1/"
    local dict=() log="$target_dir/logs/$1.log"
    mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
    if [[ -f "fuzz/dict/$t.dict" ]]; then dict=("-dict=fuzz/dict/$t.dict"); fi
    local binary="$target_dir/x86_64-unknown-linux-gnu/$out_dir/$t"
    if "$binary" "$corpus" "fuzz/corpus/$t" "${dict[@]}" \
        -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -max_len=8192 \
        -artifact_prefix="$artifacts" -print_final_stats=1 >"$log" 2>&1; then
        local runs
        runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
        echo "fuzz: $t: ok, $runs executions in ${seconds} s ($(find "$corpus" -type f | wc -l) inputs in its corpus)"
    else
        echo "fuzz: $t FAILED; the end of its log ($log):" >&2
        tail -n 40 "$log" >&2
        local repro
        repro=$(ls -t "$artifacts" 2>/dev/null | head -n 1)
        if [[ -n "$repro" ]]; then
            echo "fuzz: $t: reproducer: $artifacts$repro" >&2
            echo "fuzz: rerun it with: $binary $artifacts$repro" >&2
        else
            echo "fuzz: $t: no reproducer written" >&2
        fi
        return 1
    fi
}

failed=0
for t in "${targets[@]}"; do
    run "$t" || failed=1
done
echo "fuzz: done in $(($(date +%s) - start)) s"
exit "$failed"
