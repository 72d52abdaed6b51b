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
# Each "ours" phase is `pdctl bench-model` (prefill, best decode steps at batch 1 and BATCH) plus
# `pdctl run` timed for GEN tokens (the serving path's mean decode speed, llama-bench's tg sense);
# each llama.cpp phase is preceded by a read-bandwidth probe (bench-model's), as the host's memory
# bandwidth drifts. Prints a table: tokens/s for both (best, with the range), the ratios
# ours/theirs per GGUF type, and batch-1 decode as a fraction of the read bandwidth measured in
# the same phase or the nearest probes. Raw JSON of every phase stays in OUT_DIR.
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

# Mean decode speed of our whole serving path (`pdctl run`: scheduler, sampling, detokenizing)
# in llama-bench's tg sense: GEN tokens after a 1-token prompt, timed as the difference between
# generating GEN + 1 tokens and 1 token (start-up, loading and prefill cancel out), REPS times.
cat >"$OUT_DIR/gen_timer.py" <<'PY'
import json, subprocess, sys, time
pdctl, model, gen, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def timed(n):
    t = time.perf_counter()
    subprocess.run([pdctl, "run", "--model", model, "--token-ids", "9707", "--max-tokens", str(n),
                    "--ignore-eos"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t
timed(1)  # page the weights in
out = []
for _ in range(reps):
    one, full = timed(1), timed(gen + 1)
    out.append(gen / max(full - one, 1e-9))
print(json.dumps({"gen": gen, "tokens_per_s": out}))
PY

# Read bandwidth now (bench-model's probe: best of 3 passes over 1 GiB, before and after a
# 1-token step), around the llama.cpp phases: the shared host's memory bandwidth drifts (2x
# within minutes has been seen), so each engine is set against the bandwidth of its own moment.
probe() {
    RAYON_NUM_THREADS="$THREADS" phase "bw-$1" "$OUT_DIR/bw-$1.json" \
        "$PDCTL" bench-model --model "$MODEL" --json --prompt-len 1 --batch 1 \
        --decode-context 1 --decode-steps 1 --repeat 3
}

ours() {
    RAYON_NUM_THREADS="$THREADS" phase "ours-$1" "$OUT_DIR/ours-$1.json" \
        "$PDCTL" bench-model --model "$MODEL" --json \
        --prompt-len "$PROMPT" --batch "1,$BATCH" --repeat "$REPS"
    RAYON_NUM_THREADS="$THREADS" phase "ours-gen-$1" "$OUT_DIR/ours-gen-$1.json" \
        python3 "$OUT_DIR/gen_timer.py" "$PDCTL" "$MODEL" "$GEN" "$REPS"
}

theirs() {
    local r=$1 t
    for t in "${dtypes[@]}"; do
        probe "llama-bench-$t-$r"
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
    probe "after-$r"
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

with open(os.path.join(out, "phases")) as f:
    phases = f.read().split()

def has_bw(p):
    return p.startswith("bw-") or (p.startswith("ours-") and not p.startswith("ours-gen"))

def bw_of(name):
    """GB/s for a phase: bench-model's own probe, else the best of the nearest probes around."""
    if has_bw(name):
        return load(name + ".json")["read_bandwidth_gb_s"]
    i = phases.index(name)
    before = [p for p in phases[:i] if has_bw(p)][-1:]
    after = [p for p in phases[i + 1:] if has_bw(p)][:1]
    return max(load(p + ".json")["read_bandwidth_gb_s"] for p in before + after)

def pick(runs):
    """runs: [(phase, [tokens/s], bytes read per step or None)] -> ([(tokens/s, fraction of the
    phase's read bandwidth or None)] of the clean runs, or of all of them, and whether dirty)."""
    ok = [r for r in runs if share(r[0]) <= clean_max]
    use, dirty = (ok, False) if ok else (runs, True)
    vals = [(v, v * r[2] / 1e9 / bw_of(r[0]) if r[2] else None) for r in use for v in r[1]]
    return vals, dirty

n_ours = rounds + 1
ours = {i: load(f"ours-{i}.json") for i in range(1, n_ours + 1)}
first = ours[1]
our_bytes = first["weight_bytes_per_step"]

def o_decode(r, b):
    return next(d["tokens_per_s"] for d in r["decode"] if d["batch"] == b)

mine = {
    "pp": pick([(f"ours-{i}", [r["prefill"]["tokens_per_s"]], None) for i, r in ours.items()]),
    # the serving path's step reads the same weights; its phase has no probe of its own
    "tg": pick([(f"ours-gen-{i}", load(f"ours-gen-{i}.json")["tokens_per_s"], our_bytes)
                for i in ours]),
    "tg_best": pick([(f"ours-{i}", [o_decode(r, 1)], our_bytes) for i, r in ours.items()]),
    "tgb": pick([(f"ours-{i}", [o_decode(r, batch)], None) for i, r in ours.items()]),
}

theirs, info = {}, {}
for t in dtypes:
    runs = {"pp": [], "tg": [], "tg_best": [], "tgb": []}
    for r in range(1, rounds + 1):
        n = f"llama-bench-{t}-{r}"
        rows = load(n + ".json")
        pp = next(x for x in rows if x["n_prompt"] > 0 and x["n_gen"] == 0)
        tg = next(x for x in rows if x["n_gen"] > 0 and x["n_prompt"] == 0)
        info[t] = tg
        runs["pp"].append((n, pp["samples_ts"], None))
        runs["tg"].append((n, tg["samples_ts"], tg["model_size"]))
        n = f"batched-bench-{t}-{r}"
        path = os.path.join(out, n + ".jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for x in (json.loads(l) for l in f if l.strip().startswith("{")):
                    if x["pl"] == 1:
                        runs["tg_best"].append((n, [x["speed_tg"]], tg["model_size"]))
                    if x["pl"] == batch:
                        runs["tgb"].append((n, [x["speed_tg"]], None))
    theirs[t] = {k: pick(v) if v else ([], False) for k, v in runs.items()}

def cell(c):
    vals, dirty = c
    if not vals:
        return "-"
    xs = [v for v, _ in vals]
    mark = "*" if dirty else ""
    if len(xs) == 1:
        return f"{xs[0]:.1f}{mark}"
    return f"{max(xs):.1f} ({min(xs):.0f}-{max(xs):.0f}){mark}"

def frac(c):
    fs = [f for _, f in c[0] if f is not None]
    return f"{100 * max(fs):.0f} %" if fs else "-"

def ratio(a, b):
    return f"{max(v for v, _ in a[0]) / max(v for v, _ in b[0]):.2f}" if a[0] and b[0] else "-"

bws = [load(p + ".json")["read_bandwidth_gb_s"] for p in phases if has_bw(p)]
print()
print(f"machine: {info[dtypes[0]].get('cpu_info', '?')}, threads: ours {first['threads']}, "
      f"llama.cpp {info[dtypes[0]].get('n_threads', '?')} (build {info[dtypes[0]].get('build_commit', '?')})")
print(f"memory read bandwidth during the run (pdctl probe): {min(bws):.1f}-{max(bws):.1f} GB/s")
print("other processes' share of the CPUs during each phase (0 % = the benchmark ran alone):")
print("  " + ", ".join(f"{n} {share(n):.0f} %" for n in phases if not n.startswith("bw-")))
print(f"ours: {first['model']} ({first['dtype']}), {n_ours} runs; llama.cpp: {rounds} run(s) x "
      "repetitions. Cells: tokens/s, best (range) over the")
print(f"clean runs/repetitions; clean = others took <= {clean_max:g} % of the CPUs; "
      "* = none was clean, all shown.")
print()
W, R = 22, 10
hdr = f"{'':34}{'ours':>{W}}"
for t in dtypes:
    hdr += f"{'llama.cpp ' + t:>{W}}{'ours/' + t:>{R}}"
print(hdr)

def row(label, key):
    s = f"{label:34}{cell(mine[key]):>{W}}"
    for t in dtypes:
        c = theirs[t][key]
        s += f"{cell(c):>{W}}{ratio(mine[key], c):>{R}}"
    print(s)

def frow(label, key):
    s = f"{label:34}{frac(mine[key]):>{W}}"
    for t in dtypes:
        s += f"{frac(theirs[t][key]):>{W}}{'':>{R}}"
    print(s)

gen = load("ours-gen-1.json")["gen"]
bb = any(theirs[t]["tgb"][0] for t in dtypes)
row(f"prefill, prompt {first['prefill']['prompt_len']}", "pp")
row(f"decode b1, mean of {gen} tokens", "tg")
frow("  fraction of read bandwidth", "tg")
row("decode b1, ctx 128, best step" + ("/bb" if bb else ""), "tg_best")
frow("  fraction of read bandwidth", "tg_best")
row(f"decode b{batch}, ctx 128, best step" + ("/bb" if bb else ""), "tgb")
print()
print(f"prefill: ours = bench-model, best of --repeat single passes; llama.cpp = llama-bench "
      f"pp{first['prefill']['prompt_len']}, per repetition.")
print(f"decode b1 mean: ours = `pdctl run` (the serving path), {gen} tokens after a 1-token prompt,")
print(f"timed as t({gen}+1 tokens) - t(1 token); llama.cpp = llama-bench tg{gen}, per repetition.")
print("best step: bench-model's fastest of 32 decode steps after a 128-token context"
      + ("; bb = llama-batched-bench\n-npp 128 -ntg 32: aggregate tokens/s over its 32 steps."
         if bb else "."))
print("fraction of read bandwidth: weight bytes per step x tokens/s over pdctl's probe taken in the")
print("same phase (bench-model) or the nearest before/after; the probe is a plain summing loop,")
print("so a kernel that streams better than it can exceed 100 %.")
EOF
