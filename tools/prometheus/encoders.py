"""The nodes' /metrics encoder against metrics-exporter-prometheus, under a real Prometheus.

Usage (scripts/prometheus-check.sh runs both):
  python3 tools/prometheus/encoders.py record --node-metrics ADDR... --out DIR --stop-file F
  python3 tools/prometheus/encoders.py compare --a DIR --b DIR [--report FILE]

record: fetches every node's /metrics every 0.5 s into DIR/node<i>/<n>.txt until F exists
  (the script runs it during the load).
compare: A is what the nodes wrote (their own encoder); B is the same snapshots as
  metrics-exporter-prometheus renders them (node-common/examples/exporter_twin.rs). Checks:
  1. the expositions, parsed by prometheus_client: the same families, types, help texts and
     samples in A and B (label order and the spelling of numbers aside), and how they differ
     in text;
  2. a Prometheus per side (plus one scraping both sides, as a fleet mid-migration would be)
     scrapes a replay of the snapshots: the n-th scrape of a node gets its n-th snapshot, every
     sample stamped n seconds after a common start (an explicit timestamp appended to each
     sample line, the same on both sides), so both sides hold the same samples at the same
     times whatever the scrape timing;
  3. every PromQL expression of deploy/grafana/*.json (template variables resolved on each
     side, "All" and one value) and deploy/prometheus/*.yml, and the expressions of vLLM's own
     example Grafana dashboard that read the series the nodes serve, evaluated on both sides
     at the same instant; results compared series by series.
  Exit status 1 when any of those expressions gives different results on the two sides (other
  than in the spelling of an `le` label value); the report says which and how.
"""

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_live import (  # noqa: E402
    DASHBOARDS,
    RULE_FILES,
    Failures,
    api,
    dashboard_panels,
    label_values_query,
    substitute,
)

# Expressions of vLLM's example dashboard (vllm-project/vllm,
# examples/online_serving/prometheus_grafana/grafana.json) that read series the nodes serve,
# by what they compute; `$model_name` is set to the served model. Its panels on series the
# v1 engine no longer has (time_per_output_token, gpu_cache_usage_perc,
# request_max_num_generation_tokens) read nothing on either side and are left out.
VLLM_DASHBOARD = [
    ("e2e latency p99", "histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=\"$model_name\"}[1m])))"),
    ("e2e latency p50", "histogram_quantile(0.5, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=\"$model_name\"}[1m])))"),
    ("e2e latency mean", "rate(vllm:e2e_request_latency_seconds_sum{model_name=\"$model_name\"}[1m]) / rate(vllm:e2e_request_latency_seconds_count{model_name=\"$model_name\"}[1m])"),
    ("prompt tokens/s", "rate(vllm:prompt_tokens_total{model_name=\"$model_name\"}[1m])"),
    ("generation tokens/s", "rate(vllm:generation_tokens_total{model_name=\"$model_name\"}[1m])"),
    ("requests running", "vllm:num_requests_running{model_name=\"$model_name\"}"),
    ("requests waiting", "vllm:num_requests_waiting{model_name=\"$model_name\"}"),
    ("TTFT p99", "histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name=\"$model_name\"}[1m])))"),
    ("TTFT p90", "histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name=\"$model_name\"}[1m])))"),
    ("TTFT mean", "rate(vllm:time_to_first_token_seconds_sum{model_name=\"$model_name\"}[1m]) / rate(vllm:time_to_first_token_seconds_count{model_name=\"$model_name\"}[1m])"),
    ("prompt length heatmap (by le)", "sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name=\"$model_name\"}[1m]))"),
    ("generation length heatmap (by le)", "sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name=\"$model_name\"}[1m]))"),
    ("finish reasons", "sum by(finished_reason) (increase(vllm:request_success_total{model_name=\"$model_name\"}[1m]))"),
    ("queue time", "rate(vllm:request_queue_time_seconds_sum{model_name=\"$model_name\"}[1m])"),
    ("prefill time", "rate(vllm:request_prefill_time_seconds_sum{model_name=\"$model_name\"}[1m])"),
    ("decode time", "rate(vllm:request_decode_time_seconds_sum{model_name=\"$model_name\"}[1m])"),
    ("model_name variable", "count by (model_name) ({__name__=~\"vllm:.*\"})"),
]
# Not in any dashboard or rule: what a consumer that selects one bucket by its spelling sees.
PROBES = [
    ("one bucket selected as le=\"1.0\"", "vllm:time_to_first_token_seconds_bucket{le=\"1.0\"}"),
    ("one bucket selected as le=\"1\"", "vllm:time_to_first_token_seconds_bucket{le=\"1\"}"),
]
STEP_MS = 1000
SCRAPE = "200ms"
# Each snapshot is served to this many scrapes in a row (the repeats add nothing: same
# timestamp, same value), so that a scrape that times out on a busy machine loses no sample.
REPEAT = 3
# At most this many snapshots are replayed (evenly chosen from what was recorded).
MAX_SNAPSHOTS = 40


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- record --------------------------------------------------------------------------------


def record(args):
    n = 0
    while not os.path.exists(args.stop_file) and n < args.max:
        for i, addr in enumerate(args.node_metrics):
            d = os.path.join(args.out, f"node{i}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{n:04}.txt"), "w") as f:
                f.write(http_get(f"http://{addr}/metrics"))
        n += 1
        time.sleep(args.interval)
    print(f"ok   recorded {n} snapshots of {len(args.node_metrics)} nodes")


# --- compare: the expositions ----------------------------------------------------------------


def snapshots(root):
    """{node: [text, ...]} in order."""
    out = {}
    for node in sorted(os.listdir(root)):
        d = os.path.join(root, node)
        files = sorted(os.listdir(d))
        if len(files) > MAX_SNAPSHOTS:
            files = [files[round(i * (len(files) - 1) / (MAX_SNAPSHOTS - 1))] for i in range(MAX_SNAPSHOTS)]
        out[node] = [open(os.path.join(d, f)).read() for f in files]
    return out


def families(text):
    fams = {}
    for f in text_string_to_metric_families(text):
        samples = {}
        for s in f.samples:
            labels = dict(s.labels)
            if "le" in labels:
                labels["le"] = float(labels["le"])
            samples[(s.name, frozenset(labels.items()))] = s.value
        fams[f.name] = (f.type, f.documentation, samples)
    return fams


def close(x, y):
    if isinstance(x, float) and math.isnan(x):
        return isinstance(y, float) and math.isnan(y)
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def compare_expositions(a, b, out):
    """Parsed families of every snapshot pair; text-level differences of the last one."""
    problems = []
    for node in a:
        for i, (ta, tb) in enumerate(zip(a[node], b[node])):
            fa, fb = families(ta), families(tb)
            for name in sorted(set(fa) | set(fb)):
                if name not in fb:
                    if fa[name][2]:
                        problems.append(f"{node}/{i}: family {name} missing from the exporter's output")
                    continue
                if name not in fa:
                    problems.append(f"{node}/{i}: family {name} only in the exporter's output")
                    continue
                (ka, ha, sa), (kb, hb, sb) = fa[name], fb[name]
                if ka != kb or ha != hb:
                    problems.append(f"{node}/{i}: {name}: type/help {ka!r} {ha!r} vs {kb!r} {hb!r}")
                if set(sa) != set(sb):
                    problems.append(f"{node}/{i}: {name}: series {sorted(set(sa) ^ set(sb), key=str)[:3]}")
                    continue
                for k in sa:
                    if not close(sa[k], sb[k]):
                        problems.append(f"{node}/{i}: {k[0]}{dict(k[1])}: {sa[k]} vs {sb[k]}")
    # How the text differs (the last snapshot of the first node), line by line, for the report.
    node = sorted(a)[0]
    la, lb = a[node][-1].splitlines(), b[node][-1].splitlines()
    out.append("Text, last snapshot of %s: %d lines (nodes' encoder) vs %d (exporter)." % (node, len(la), len(lb)))
    for pattern in (r"^vllm:time_to_first_token_seconds_bucket\{.*le=\"1(\.0)?\"", r"^vllm:prompt_tokens_total\{", r"^# HELP vllm:prompt_tokens_total", r"^# TYPE vllm:iteration_tokens_total"):
        for name, lines in (("node", la), ("exporter", lb)):
            hit = next((l for l in lines if re.search(pattern, l)), None)
            if hit:
                out.append(f"  {name:8}: {hit}")
    return problems


# --- compare: Prometheus -------------------------------------------------------------------------


class Replay:
    """Serves /<side>/<node>: the n-th snapshot to REPEAT requests in a row (the last one from
    then on), each sample line stamped start + n * STEP_MS."""

    def __init__(self, sides):
        self.sides = sides  # {side: {node: [text]}}
        self.served = {}
        self.lock = threading.Lock()
        self.n = min(len(texts) for nodes in sides.values() for texts in nodes.values())
        self.start_ms = int(time.time() * 1000) - (self.n + 10) * STEP_MS
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                parts = self.path.strip("/").split("/")
                try:
                    texts = replay.sides[parts[0]][parts[1]]
                except (KeyError, IndexError):
                    self.send_error(404)
                    return
                with replay.lock:
                    k = replay.served.get(self.path, 0)
                    replay.served[self.path] = k + 1
                i = min(k // REPEAT, replay.n - 1)
                ts = replay.start_ms + i * STEP_MS
                body = "".join(
                    line + ("\n" if line.startswith("#") or not line.strip() else f" {ts}\n")
                    for line in texts[i].splitlines()
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def done(self, paths):
        with self.lock:
            return all(self.served.get(p, 0) >= (self.n + 1) * REPEAT for p in paths)

    def instant(self):
        """The evaluation instant: just after the last snapshot's timestamp."""
        return (self.start_ms + (self.n - 1) * STEP_MS) / 1000 + 0.5


def start_prometheus(work, name, replay, targets):
    """targets: [(path, instance)]. Returns (url, process)."""
    d = os.path.join(work, name)
    os.makedirs(d)
    config = {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE},
        "scrape_configs": [
            {
                "job_name": instance,
                "metrics_path": path,
                "static_configs": [
                    {"targets": [f"127.0.0.1:{replay.port}"], "labels": {"job": "vllm", "instance": instance}}
                ],
            }
            for path, instance in targets
        ],
    }
    with open(os.path.join(d, "prometheus.yml"), "w") as f:
        yaml.safe_dump(config, f)
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={d}/prometheus.yml", f"--storage.tsdb.path={d}/tsdb",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=open(os.path.join(d, "log"), "w"), stderr=subprocess.STDOUT,
    )
    return f"http://127.0.0.1:{port}", proc


def query(prom, expr, at):
    try:
        result = api(prom, "query", query=expr, time=at)
    except RuntimeError as e:
        return f"error: {e}"
    if result["resultType"] == "scalar":
        return {frozenset(): float(result["result"][1])}
    return {frozenset(s["metric"].items()): float(s["value"][1]) for s in result["result"]}


def le_normalized(result):
    return {
        frozenset((k, repr(float(v)) if k == "le" else v) for k, v in key): value
        for key, value in result.items()
    }


def verdict(ra, rb):
    """'same', 'le-spelling' (same numbers, `le` label values spelled differently) or 'differ'."""
    if isinstance(ra, str) or isinstance(rb, str):
        return "same" if ra == rb else "differ"
    for x, y in ((ra, rb), (le_normalized(ra), le_normalized(rb))):
        if set(x) == set(y) and all(close(x[k], y[k]) for k in x):
            return "same" if x is ra else "le-spelling"
    return "differ"


def show(result, limit=4):
    if isinstance(result, str):
        return result
    items = sorted(result.items(), key=lambda kv: sorted(kv[0]))[:limit]
    text = ", ".join(f"{dict(sorted(k))} {v:.6g}" for k, v in items)
    return f"[{len(result)} series] {text}" + (" ..." if len(result) > limit else "")


def variables(prom, dash):
    """A dashboard's query variables as check_live resolves them ("All", then one value
    each), except that values come from the nodes' series: the replay has no router, whose
    series the shipped dashboard's variables read."""
    every, one = {}, {}
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        _, label = label_values_query(q)
        values = api(prom, f"label/{label}/values", **{"match[]": '{__name__=~"vllm:.*"}'})
        every[v["name"]] = v.get("allValue") or "|".join(re.escape(x) for x in values)
        one[v["name"]] = re.escape(values[0]).replace("\\", "\\\\") if values else ""
    return every, one


def expressions(prom_a, prom_b, model, fail):
    """(what, expr_a, expr_b): the same expression, template variables resolved per side."""
    out = []
    for path in DASHBOARDS:
        dash = json.load(open(path))
        sel_a, sel_b = variables(prom_a, dash), variables(prom_b, dash)
        if sel_a != sel_b:
            fail.add(f"{os.path.basename(path)}: template variables differ: {sel_a} vs {sel_b}")
        for p in dashboard_panels(dash["panels"]):
            for t in p.get("targets", []):
                for label, va, vb in zip(("all", "one"), sel_a, sel_b):
                    what = f"{os.path.basename(path)} {p['title']!r} {t['refId']} ({label})"
                    out.append((what, substitute(t["expr"], va), substitute(t["expr"], vb)))
    for path in RULE_FILES:
        for group in yaml.safe_load(open(path))["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule.get("alert")
                out.append((f"{os.path.basename(path)} {name}", rule["expr"], rule["expr"]))
    for what, expr in VLLM_DASHBOARD:
        expr = expr.replace("$model_name", model)
        out.append((f"vLLM dashboard: {what}", expr, expr))
    return out


def compare(args):
    fail = Failures()
    report = []
    version = subprocess.run(["prometheus", "--version"], capture_output=True, text=True)
    version = (version.stdout or version.stderr).splitlines()[0]
    report.append(version)
    a, b = snapshots(args.a), snapshots(args.b)
    report.append(f"{len(a)} nodes, {min(len(t) for t in a.values())} snapshots each")

    problems = compare_expositions(a, b, report)
    for p in problems:
        fail.add(f"exposition: {p}")
    passed = 0 if problems else 1
    if not problems:
        print("ok   every snapshot: the same families, types, help texts and samples on both sides")

    model = next(
        s.labels["model_name"]
        for f in text_string_to_metric_families(next(iter(a.values()))[0])
        for s in f.samples
        if "model_name" in s.labels
    )
    replay = Replay({"a": a, "b": b})
    work = tempfile.mkdtemp()
    procs = []
    try:
        nodes = sorted(a)
        side = lambda s: [(f"/{s}/{n}", n) for n in nodes]  # noqa: E731
        prom_a, p = start_prometheus(work, "a", replay, side("a"))
        procs.append(p)
        prom_b, p = start_prometheus(work, "b", replay, side("b"))
        procs.append(p)
        mixed = [(path, f"{s}-{n}") for s in ("a", "b") for path, n in side(s)]
        prom_ab, p = start_prometheus(work, "ab", replay, mixed)
        procs.append(p)
        paths = [path for path, _ in mixed]
        deadline = time.monotonic() + 120
        while not replay.done(paths):
            if time.monotonic() > deadline:
                sys.exit(f"the replay was not scraped to the end: {replay.served}")
            time.sleep(0.5)
        time.sleep(1)  # the last scrapes' samples committed
        at = replay.instant()
        for prom, targets in ((prom_a, len(nodes)), (prom_b, len(nodes)), (prom_ab, 2 * len(nodes))):
            got = query(prom, "count_over_time(vllm:num_requests_running[1h])", at)
            if len(got) != targets or any(v != replay.n for v in got.values()):
                sys.exit(f"{prom} did not ingest every snapshot of every node: {show(got)}")
        print(f"ok   {replay.n} snapshots replayed to 3 Prometheus instances; evaluating at {at:.3f}")

        counts = {"same": 0, "le-spelling": 0, "differ": 0}
        mixed_notes = []
        empty = 0
        report.append("")
        report.append("Expressions (A: nodes' encoder, B: exporter):")
        for what, ea, eb in expressions(prom_a, prom_b, model, fail):
            ra, rb = query(prom_a, ea, at), query(prom_b, eb, at)
            v = verdict(ra, rb)
            counts[v] += 1
            if ra == {} and rb == {}:
                empty += 1
            if v == "differ":
                fail.add(f"{what}: differs\n     {ea}\n     A {show(ra)}\n     B {show(rb)}")
            else:
                passed += 1
            if v != "same":
                report.append(f"- {v}: {what}\n    {ea}\n    A: {show(ra)}\n    B: {show(rb)}")
            # A fleet mid-migration: one Prometheus scraping both spellings. Quantiles must not
            # move (Prometheus merges buckets with the same bound); sums double.
            if "histogram_quantile" in ea and "instance" not in ea and isinstance(ra, dict) and ra:
                rab = query(prom_ab, ea, at)
                if verdict(ra, rab) != "same":
                    fail.add(f"{what}: both spellings in one Prometheus\n     A  {show(ra)}\n     AB {show(rab)}")
                else:
                    passed += 1
            elif re.search(r"by ?\((le|.*, *le)\)", ea) and isinstance(ra, dict) and ra:
                rab = query(prom_ab, ea, at)
                mixed_notes.append(
                    f"- {what}: {len(ra)} series on A, {len(rab)} with both spellings in one "
                    f"Prometheus (le values {sorted({dict(k).get('le') for k in rab}, key=str)[:6]}...)"
                )
        report.append(
            f"{sum(counts.values())} expressions: {counts['same']} identical, "
            f"{counts['le-spelling']} identical but for the spelling of le, {counts['differ']} different; "
            f"{empty} read no node series on either side (router-only series)"
        )
        report.append("")
        report.append(
            "Both spellings in one Prometheus (a fleet mid-migration, or vLLM servers beside the nodes): "
            "every histogram_quantile above gives A's result; what a sum by (le) gives:"
        )
        report.extend(mixed_notes or ["- (no such expression read data)"])
        report.append("")
        report.append("Probes (no shipped dashboard or rule does this):")
        for what, expr in PROBES:
            report.append(f"- {what}: {expr}\n    A: {show(query(prom_a, expr, at))}\n    B: {show(query(prom_b, expr, at))}")
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        replay.server.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(report)
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    fail.exit(passed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--node-metrics", nargs="+", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--stop-file", required=True)
    r.add_argument("--interval", type=float, default=0.5)
    r.add_argument("--max", type=int, default=120)
    c = sub.add_parser("compare")
    c.add_argument("--a", required=True)
    c.add_argument("--b", required=True)
    c.add_argument("--report")
    args = ap.parse_args()
    {"record": record, "compare": compare}[args.command](args)


if __name__ == "__main__":
    main()
