#!/usr/bin/env bash
# Side-by-side CPU benchmark: our `pdctl bench-model` against llama.cpp's `llama-bench` on the
# same checkpoint, on the same machine, in one run, alternating ours → theirs → ours so that a
# drift in the shared machine's speed shows up as a gap between our two runs.
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
#   REPS                 repetitions for both (default 3)
#   PROMPT               prompt length for prefill (default 512)
#   GEN                  llama-bench generated tokens (default 128)
#   BATCH                decode batch compared besides 1 (default 16)
#   DTYPES               GGUF types to run (default "bf16 f16 f32"; missing files are skipped)
#   OUT_DIR              where the raw outputs are kept (default: a new temporary directory)
#   QUIET_WAIT_S         before each phase, wait up to this many seconds for the CPUs to be idle
#                        (< QUIET_BUSY % busy over 2 s, default 10) — other processes on a shared
#                        machine slow llama.cpp's spinning thread pool far more than rayon
#                        (default 0: no waiting; the busy % at each start is printed either way)
#
# Prints a table: prefill and decode tokens/s for both, the ratios ours/theirs per GGUF type, and
# the fraction of the memory read bandwidth (measured by pdctl in the same run) each achieves in
# batch-1 decode. The raw JSON of every run stays in OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${LLAMA_BENCH:?set LLAMA_BENCH to the llama-bench binary}"
: "${GGUF_DIR:?set GGUF_DIR to the directory with {bf16,f16,f32}.gguf}"
MODEL="${MODEL:-synthetic:qwen3-0.6b}"
THREADS="${THREADS:-$(nproc)}"
REPS="${REPS:-3}"
PROMPT="${PROMPT:-512}"
GEN="${GEN:-128}"
BATCH="${BATCH:-16}"
DTYPES="${DTYPES:-bf16 f16 f32}"
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

QUIET_WAIT_S="${QUIET_WAIT_S:-0}"
QUIET_BUSY="${QUIET_BUSY:-10}"

# Percentage of all CPU time spent busy over the next 2 seconds.
busy() {
    local a b
    read -r -a a < <(head -1 /proc/stat)
    sleep 2
    read -r -a b < <(head -1 /proc/stat)
    local total=0 idle i
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    idle=$((b[4] - a[4] + b[5] - a[5]))
    echo $(((100 * (total - idle)) / (total > 0 ? total : 1)))
}
# Waits (up to QUIET_WAIT_S) for an idle machine; records the busy % seen at the start.
settle() {
    local name=$1 waited=0 b
    b=$(busy)
    while ((b >= QUIET_BUSY && waited < QUIET_WAIT_S)); do
        sleep 8
        waited=$((waited + 10))
        b=$(busy)
    done
    echo "$b" >"$OUT_DIR/$name.busy"
}
log() { echo "[$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)] $*" >&2; }

# measured NAME OUT CMD...: runs CMD with stdout to OUT and stderr to OUT.err, and writes NAME.meta
# (JSON): wall time, the command's own CPU seconds, and the CPU seconds every other process on the
# machine used meanwhile ("others_share" = their fraction of all CPU time during the phase).
measured() {
    local name=$1 out=$2
    shift 2
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
    local n=$1
    settle "ours-$n"
    log "ours #$n (cpu busy $(cat "$OUT_DIR/ours-$n.busy") %): $PDCTL bench-model --model $MODEL --json"
    RAYON_NUM_THREADS="$THREADS" measured "ours-$n" "$OUT_DIR/ours-$n.json" \
        "$PDCTL" bench-model --model "$MODEL" --json \
        --prompt-len "$PROMPT" --batch "1,$BATCH" --repeat "$REPS"
}

ours 1
for t in "${dtypes[@]}"; do
    settle "llama-bench-$t"
    log "theirs $t (cpu busy $(cat "$OUT_DIR/llama-bench-$t.busy") %):" \
        "llama-bench -m $GGUF_DIR/$t.gguf -t $THREADS -p $PROMPT -n $GEN -r $REPS"
    measured "llama-bench-$t" "$OUT_DIR/llama-bench-$t.json" \
        "$LLAMA_BENCH" -m "$GGUF_DIR/$t.gguf" -t "$THREADS" -p "$PROMPT" -n "$GEN" -r "$REPS" -o json
    if [[ -n "${LLAMA_BATCHED_BENCH:-}" ]]; then
        # Same decode context as ours (bench-model decodes after a 128-token context).
        settle "batched-bench-$t"
        log "theirs $t (cpu busy $(cat "$OUT_DIR/batched-bench-$t.busy") %): llama-batched-bench -npp 128 -ntg 32 -npl 1,$BATCH -t $THREADS"
        measured "batched-bench-$t" "$OUT_DIR/batched-bench-$t.jsonl" \
            "$LLAMA_BATCHED_BENCH" -m "$GGUF_DIR/$t.gguf" -c $(((128 + 32) * BATCH + 256)) \
            -npp 128 -ntg 32 -npl "1,$BATCH" -t "$THREADS" --output-format jsonl
    fi
done
ours 2
log "done; raw outputs in $OUT_DIR"

python3 - "$OUT_DIR" "$BATCH" "${dtypes[@]}" <<'EOF'
import json, os, sys

out, batch, dtypes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)

def first_line(name):
    with open(os.path.join(out, name)) as f:
        return f.read().strip()

ours = [load("ours-1.json"), load("ours-2.json")]

def o_prefill(r):
    return r["prefill"]["tokens_per_s"]

def o_decode(r, b):
    return next(d["tokens_per_s"] for d in r["decode"] if d["batch"] == b)

bw = max(r["read_bandwidth_gb_s"] for r in ours)  # GB/s, pdctl's best of before/after, both runs
our_bytes = ours[0]["weight_bytes_per_step"]
o_pp = [o_prefill(r) for r in ours]
o_tg = [o_decode(r, 1) for r in ours]
o_tgb = [o_decode(r, batch) for r in ours]

def mid(xs):
    return sum(xs) / len(xs)

theirs = {}
for t in dtypes:
    rows = load(f"llama-bench-{t}.json")
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    entry = {
        "pp_avg": pp["avg_ts"], "pp_best": max(pp["samples_ts"]),
        "tg_avg": tg["avg_ts"], "tg_best": max(tg["samples_ts"]),
        "bytes": tg["model_size"], "commit": tg.get("build_commit", "?"),
        "cpu": tg.get("cpu_info", "?"), "threads": tg.get("n_threads", "?"),
    }
    path = os.path.join(out, f"batched-bench-{t}.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            recs = [json.loads(l) for l in f if l.strip().startswith("{")]
        for r in recs:
            if r["pl"] == batch:
                entry["tgb"] = r["speed_tg"]
            if r["pl"] == 1:
                entry["tg1_ctx"] = r["speed_tg"]
    theirs[t] = entry

def f(x):
    return "-" if x is None else f"{x:.1f}"

def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"

print()
print(f"machine: {theirs[dtypes[0]]['cpu']}, {ours[0]['threads']} threads (ours) / "
      f"{theirs[dtypes[0]]['threads']} (llama.cpp {theirs[dtypes[0]]['commit']})")
print(f"memory read bandwidth (pdctl, best of 4 measurements): {bw:.1f} GB/s")
phases = ["ours-1"] + [f"{k}-{t}" for t in dtypes for k in ("llama-bench", "batched-bench")
                       if os.path.exists(os.path.join(out, f"{k}-{t}.busy"))] + ["ours-2"]
print("other processes' share of the CPUs during each phase (0 % = the benchmark ran alone):")
print("  " + ", ".join(f"{n} {100 * load(n + '.meta')['others_share']:.0f} %" for n in phases))
print(f"ours: {ours[0]['model']} ({ours[0]['dtype']}), runs 1 / 2; "
      "llama.cpp: best repetition (mean of repetitions)")
print()
hdr = f"{'':28}{'ours #1':>9}{'ours #2':>9}"
for t in dtypes:
    hdr += f"{'llama.cpp ' + t:>21}{'ours/' + t:>11}"
print(hdr)

def row(label, mine, key_best, key_avg=None):
    s = f"{label:28}{f(mine[0]):>9}{f(mine[1]):>9}"
    for t in dtypes:
        e = theirs[t]
        best = e.get(key_best)
        cell = f(best) if key_avg is None else f"{f(best)} ({f(e.get(key_avg))})"
        s += f"{cell:>21}{ratio(mid(mine), best):>11}"
    print(s)

row(f"prefill tok/s (prompt {ours[0]['prefill']['prompt_len']})", o_pp, "pp_best", "pp_avg")
row("decode tok/s, batch 1", o_tg, "tg_best", "tg_avg")
if any("tg1_ctx" in theirs[t] for t in dtypes):
    row("  batch 1 at ctx 128 (bb)", o_tg, "tg1_ctx")
row(f"decode tok/s, batch {batch}" + (" (bb)" if any("tgb" in theirs[t] for t in dtypes) else ""),
    o_tgb, "tgb")
s = f"{'batch-1 decode % of read bw':28}"
s += "".join(f"{100 * our_bytes * x / 1e9 / bw:>8.0f}%" for x in o_tg)
for t in dtypes:
    e = theirs[t]
    s += f"{100 * e['bytes'] * e['tg_best'] / 1e9 / bw:>20.0f}%{'':>11}"
print(s)
print()
print("ratios use the mean of our two runs. ours: best single step / best of "
      "repetitions; llama-bench: tokens over the whole timed run.")
print("(bb) = llama-batched-bench -npp 128 -ntg 32: aggregate decode tokens/s after a 128-token prompt.")
EOF
