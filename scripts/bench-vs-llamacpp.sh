#!/usr/bin/env bash
# Side-by-side CPU benchmark: our `pdctl bench-model` against llama.cpp's `llama-bench` on the
# same checkpoint, on the same machine, in one run, alternating ours → theirs → ours (→ theirs →
# ours … for ROUNDS > 1), so that both meet the same machine and a drift shows up as a spread.
#
# This script does NOT build or download llama.cpp, nor convert checkpoints: see
# docs/benchmarks.md for how the peer binaries and the GGUF files are made (outside this repo).
#
# Environment:
#   LLAMA_BENCH          path to llama.cpp's llama-bench (required)
#   GGUF_DIR             directory with bf16.gguf, f16.gguf and/or f32.gguf, converted from the
#                        checkpoint that MODEL names (required)
#   LLAMA_BATCHED_BENCH  path to llama-batched-bench (optional: adds llama.cpp's batch-N decode)
#   PDCTL                our binary (default target/release/pdctl; `cargo build --release -p pdctl`
#                        is run first when PDCTL is unset)
#   MODEL                our --model (default synthetic:qwen3-0.6b, a bf16 checkpoint)
#   THREADS              threads for both engines (default: nproc)
#   REPS                 repetitions inside each run, for both (default 3)
#   ROUNDS               theirs-between-ours rounds (default 1: ours, theirs, ours)
#   PROMPT               prompt length for prefill (default 512)
#   GEN                  llama-bench generated tokens (default 128)
#   BATCH                decode batch compared besides 1 (default 16)
#   DTYPES               GGUF types to run (default "bf16 f16 f32"; missing files are skipped)
#   OUT_DIR              where the raw outputs are kept (default: a new temporary directory)
#   QUIET_WAIT_S         before each phase, wait up to this many seconds for the CPUs to be idle
#                        (< QUIET_BUSY % busy over 2 s, default 10); default 0: no waiting
#   REPORT_ONLY=1        run nothing: print the table of an earlier run's OUT_DIR (same ROUNDS, DTYPES)
#   CLEAN_MAX            a run counts in the table only if other processes took at most this % of
#                        the CPUs during it (default 10); when no run of a kind is that clean, all
#                        of them count and the cell is marked `*`
#
# Other processes on a shared machine slow llama.cpp's spinning thread pool far more than our
# rayon pool, and a best-of figure less than a mean: every phase records the share of the CPUs
# that other processes took while it ran, and the table prints it; trust a run where it is ~0.
#
# Prints a table: prefill and decode tokens/s for both (best over all runs, with the range), the
# ratios ours/theirs per GGUF type, and the fraction of the memory read bandwidth (measured by
# pdctl in the same run) each achieves in batch-1 decode. Raw JSON of every run stays in OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${LLAMA_BENCH:?set LLAMA_BENCH to the llama-bench binary}"
: "${GGUF_DIR:?set GGUF_DIR to the directory with {bf16,f16,f32}.gguf}"
MODEL="${MODEL:-synthetic:qwen3-0.6b}"
THREADS="${THREADS:-$(nproc)}"
REPS="${REPS:-3}"
ROUNDS="${ROUNDS:-1}"
PROMPT="${PROMPT:-512}"
GEN="${GEN:-128}"
BATCH="${BATCH:-16}"
DTYPES="${DTYPES:-bf16 f16 f32}"
QUIET_WAIT_S="${QUIET_WAIT_S:-0}"
QUIET_BUSY="${QUIET_BUSY:-10}"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t bench-vs-llamacpp.XXXXXX)}"
mkdir -p "$OUT_DIR"

[[ -x "$LLAMA_BENCH" ]] || { echo "LLAMA_BENCH=$LLAMA_BENCH is not an executable" >&2; exit 2; }
if [[ -n "${LLAMA_BATCHED_BENCH:-}" && ! -x "$LLAMA_BATCHED_BENCH" ]]; then
    echo "LLAMA_BATCHED_BENCH=$LLAMA_BATCHED_BENCH is not an executable" >&2
    exit 2
fi
if [[ -z "${PDCTL:-}" ]]; then
    cargo build --release --quiet -p pdctl
    PDCTL=target/release/pdctl
fi
[[ -x "$PDCTL" ]] || { echo "PDCTL=$PDCTL is not an executable" >&2; exit 2; }

dtypes=()
for t in $DTYPES; do
    if [[ -f "$GGUF_DIR/$t.gguf" ]]; then
        dtypes+=("$t")
    else
        echo "note: $GGUF_DIR/$t.gguf missing, skipped" >&2
    fi
done
((${#dtypes[@]} > 0)) || { echo "no GGUF file found in $GGUF_DIR" >&2; exit 2; }

# Percentage of all CPU time spent busy over the next 2 seconds.
busy() {
    local a b total=0 idle i
    read -r -a a < <(head -1 /proc/stat)
    sleep 2
    read -r -a b < <(head -1 /proc/stat)
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    idle=$((b[4] - a[4] + b[5] - a[5]))
    echo $(((100 * (total - idle)) / (total > 0 ? total : 1)))
}

log() { echo "[$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)] $*" >&2; }

# phase NAME OUT CMD...: waits (up to QUIET_WAIT_S) for an idle machine, then runs CMD with
# stdout to OUT and stderr to OUT.err, and writes NAME.meta (JSON): wall time, the command's own
# CPU seconds, and the CPU seconds all other processes used meanwhile ("others_share" = their
# fraction of all CPU time during the phase).
phase() {
    local name=$1 out=$2 waited=0 b
    shift 2
    b=$(busy)
    while ((b >= QUIET_BUSY && waited < QUIET_WAIT_S)); do
        sleep 8
        waited=$((waited + 10))
        b=$(busy)
    done
    log "$name (cpu ${b} % busy before): $*"
    echo "$name" >>"$OUT_DIR/phases"
    python3 - "$OUT_DIR/$name.meta" "$out" "$@" <<'PY'
import json, os, resource, subprocess, sys, time
meta, out, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
def stat():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return sum(v), v[3] + v[4]
hz = os.sysconf("SC_CLK_TCK")
t0, i0 = stat(); w0 = time.time()
with open(out, "w") as o, open(out + ".err", "w") as e:
    rc = subprocess.call(cmd, stdout=o, stderr=e)
t1, i1 = stat(); w1 = time.time()
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
own = ru.ru_utime + ru.ru_stime
total, busy = (t1 - t0) / hz, (t1 - t0 - (i1 - i0)) / hz
others = max(0.0, busy - own)
json.dump({"wall_s": w1 - w0, "cpu_s": own, "others_cpu_s": others,
           "others_share": others / total if total > 0 else 0.0}, open(meta, "w"))
sys.exit(rc)
PY
}

ours() {
    RAYON_NUM_THREADS="$THREADS" phase "ours-$1" "$OUT_DIR/ours-$1.json" \
        "$PDCTL" bench-model --model "$MODEL" --json \
        --prompt-len "$PROMPT" --batch "1,$BATCH" --repeat "$REPS"
}

theirs() {
    local r=$1 t
    for t in "${dtypes[@]}"; do
        phase "llama-bench-$t-$r" "$OUT_DIR/llama-bench-$t-$r.json" \
            "$LLAMA_BENCH" -m "$GGUF_DIR/$t.gguf" -t "$THREADS" -p "$PROMPT" -n "$GEN" \
            -r "$REPS" -o json
        if [[ -n "${LLAMA_BATCHED_BENCH:-}" ]]; then
            # The decode context of bench-model: a 128-token prompt, then 32 timed steps.
            phase "batched-bench-$t-$r" "$OUT_DIR/batched-bench-$t-$r.jsonl" \
                "$LLAMA_BATCHED_BENCH" -m "$GGUF_DIR/$t.gguf" -c $(((128 + 32) * BATCH + 256)) \
                -npp 128 -ntg 32 -npl "1,$BATCH" -t "$THREADS" --output-format jsonl
        fi
    done
}

if [[ "${REPORT_ONLY:-0}" != 1 ]]; then
    : >"$OUT_DIR/phases"
    ours 1
    for ((r = 1; r <= ROUNDS; r++)); do
        theirs "$r"
        ours $((r + 1))
    done
    log "done; raw outputs in $OUT_DIR"
fi

python3 - "$OUT_DIR" "$BATCH" "$ROUNDS" "${CLEAN_MAX:-10}" "${dtypes[@]}" <<'EOF'
import json, os, sys

out, batch, rounds, clean_max = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
dtypes = sys.argv[5:]

def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)

def share(name):
    return 100 * load(name + ".meta")["others_share"]

def clean(runs):
    """runs: [(phase name, [values])] -> (values of the clean runs, or of all and True)."""
    ok = [v for n, vs in runs if share(n) <= clean_max for v in vs]
    return (ok, False) if ok else ([v for _, vs in runs for v in vs], True)

names = [f"ours-{i}" for i in range(1, rounds + 2)]
ours_all = [load(n + ".json") for n in names]
ours = [r for n, r in zip(names, ours_all) if share(n) <= clean_max] or ours_all

def o_decode(r, b):
    return next(d["tokens_per_s"] for d in r["decode"] if d["batch"] == b)

bw = max(r["read_bandwidth_gb_s"] for r in ours_all)  # GB/s: pdctl's best over every run
our_bytes = ours[0]["weight_bytes_per_step"]
mine = {
    "pp": clean([(n, [r["prefill"]["tokens_per_s"]]) for n, r in zip(names, ours_all)]),
    "tg": clean([(n, [o_decode(r, 1)]) for n, r in zip(names, ours_all)]),
    "tgb": clean([(n, [o_decode(r, batch)]) for n, r in zip(names, ours_all)]),
}

theirs = {}
info = {}
for t in dtypes:
    runs = {"pp": [], "tg": [], "tg1_ctx": [], "tgb": []}
    for r in range(1, rounds + 1):
        n = f"llama-bench-{t}-{r}"
        rows = load(n + ".json")
        pp = next(x for x in rows if x["n_prompt"] > 0 and x["n_gen"] == 0)
        tg = next(x for x in rows if x["n_gen"] > 0 and x["n_prompt"] == 0)
        runs["pp"].append((n, pp["samples_ts"]))
        runs["tg"].append((n, tg["samples_ts"]))
        info[t] = tg
        n = f"batched-bench-{t}-{r}"
        path = os.path.join(out, n + ".jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for x in (json.loads(l) for l in f if l.strip().startswith("{")):
                    if x["pl"] == 1:
                        runs["tg1_ctx"].append((n, [x["speed_tg"]]))
                    if x["pl"] == batch:
                        runs["tgb"].append((n, [x["speed_tg"]]))
    theirs[t] = {k: clean(v) if v else ([], False) for k, v in runs.items()}

def cell(c):
    xs, dirty = c
    if not xs:
        return "-"
    mark = "*" if dirty else ""
    if len(xs) == 1:
        return f"{xs[0]:.1f}{mark}"
    return f"{max(xs):.1f} ({min(xs):.0f}-{max(xs):.0f}){mark}"

def ratio(a, b):
    return f"{max(a[0]) / max(b[0]):.2f}" if a[0] and b[0] else "-"

first = info[dtypes[0]]
print()
print(f"machine: {first.get('cpu_info', '?')}, threads: ours {ours[0]['threads']}, "
      f"llama.cpp {first.get('n_threads', '?')} (build {first.get('build_commit', '?')})")
print(f"memory read bandwidth (pdctl, best of every measurement): {bw:.1f} GB/s")
print("other processes' share of the CPUs during each phase (0 % = the benchmark ran alone):")
with open(os.path.join(out, "phases")) as f:
    phases = f.read().split()
print("  " + ", ".join(f"{n} {100 * load(n + '.meta')['others_share']:.0f} %" for n in phases))
print(f"ours: {ours[0]['model']} ({ours[0]['dtype']}), {len(ours_all)} runs; llama.cpp: "
      f"{rounds} run(s) × repetitions. Cells: best (range over the clean runs/repetitions),")
print(f"tokens/s; clean = others took <= {clean_max:g} % of the CPUs; * = no clean run, all shown.")
print()
W, R = 22, 10
hdr = f"{'':30}{'ours':>{W}}"
for t in dtypes:
    hdr += f"{'llama.cpp ' + t:>{W}}{'ours/' + t:>{R}}"
print(hdr)

def row(label, key, their_key=None):
    s = f"{label:30}{cell(mine[key]):>{W}}"
    for t in dtypes:
        xs = theirs[t][their_key or key]
        s += f"{cell(xs):>{W}}{ratio(mine[key], xs):>{R}}"
    print(s)

row(f"prefill, prompt {ours[0]['prefill']['prompt_len']}", "pp")
row("decode, batch 1", "tg")
bb = any(theirs[t]["tgb"] for t in dtypes)
if bb:
    row("decode, batch 1, ctx 128 (bb)", "tg", "tg1_ctx")
row(f"decode, batch {batch}" + (", ctx 128 (bb)" if bb else ""), "tgb")
s = f"{'batch-1 decode, % of read bw':30}{100 * our_bytes * max(mine['tg'][0]) / 1e9 / bw:>{W - 1}.0f}%"
for t in dtypes:
    s += f"{100 * info[t]['model_size'] * max(theirs[t]['tg'][0]) / 1e9 / bw:>{W - 1}.0f}%{'':>{R}}"
print(s)
print()
print("ours: bench-model's best of --repeat (prefill) and best single step (decode, after a")
print("128-token context); llama-bench: each repetition's tokens over its whole timed run.")
if bb:
    print("(bb) = llama-batched-bench -npp 128 -ntg 32: aggregate decode tokens/s after a 128-token prompt.")
EOF
