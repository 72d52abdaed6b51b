"""Check the shipped dashboard and rules against a real Prometheus scraping a live cluster.

Usage (scripts/prometheus-check.sh runs it):
  python3 tools/prometheus/check_live.py expositions --router-metrics ADDR --node-metrics ADDR...
  python3 tools/prometheus/check_live.py wait-scraped --prometheus URL --targets N
  python3 tools/prometheus/check_live.py queries --prometheus URL --model NAME [--time T]

expositions: every /metrics output parses with prometheus_client's parser and passes
  `promtool check metrics` (the router's cleanly; the nodes' apart from the warnings on
  vLLM's own names: they contain ':', and one histogram ends in `_total`).
wait-scraped: waits until Prometheus has N targets, all up.
queries: evaluates through /api/v1/query every PromQL expression in deploy/grafana/*.json
  (template variables set to "All" and to one real value each) and in deploy/prometheus/*.yml,
  failing on any error, on a dashboard or recording-rule expression that returns no data, on
  a hit ratio outside [0, 1]; checks every rule is healthy in Prometheus, the router's totals
  against the sum of the nodes' own counters, and that vLLM dashboards' template query
  label_values(vllm:num_requests_running, model_name) finds the model.
"""

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARDS = sorted(glob.glob(os.path.join(ROOT, "deploy", "grafana", "*.json")))
RULE_FILES = sorted(glob.glob(os.path.join(ROOT, "deploy", "prometheus", "*.rules.yml"))) + sorted(
    glob.glob(os.path.join(ROOT, "deploy", "prometheus", "*.alerts.yml"))
)
# The only promtool lint findings allowed on a node: vLLM's metric names have a colon, and
# vLLM names one histogram with a `_total` suffix (kept so that its dashboards work).
COLON_WARNING = re.compile(
    r"^vllm:[A-Za-z0-9_:]+ metric names should not contain ':'$"
    r'|^vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix$'
)
# Grafana's interval variables, given the values Grafana would pick for a short, fresh run.
INTERVALS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s"}
# Router series that must equal the sum of the nodes' own counters, per role.
ROUTER_VS_NODES = [
    ('pd_router_prefix_cache_queries_total{cache="local"}', "vllm:prefix_cache_queries_total"),
    ('pd_router_prefix_cache_hits_total{cache="local"}', "vllm:prefix_cache_hits_total"),
    ('pd_router_prefix_cache_queries_total{cache="external"}', "vllm:external_prefix_cache_queries_total"),
    ('pd_router_prefix_cache_hits_total{cache="external"}', "vllm:external_prefix_cache_hits_total"),
    ("pd_router_prompt_tokens_total", "vllm:prompt_tokens_total"),
    ("pd_router_generation_tokens_total", "vllm:generation_tokens_total"),
]


class Failures:
    def __init__(self):
        self.items = []

    def add(self, what):
        self.items.append(what)
        print(f"FAIL {what}", flush=True)

    def exit(self, passed):
        print(f"{passed} passed, {len(self.items)} failed")
        sys.exit(1 if self.items else 0)


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def api(prom, path, **params):
    url = f"{prom}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        body = json.loads(http_get(url))
    except urllib.error.HTTPError as e:
        # Prometheus answers API errors in JSON, but while it starts up (or behind a proxy)
        # it may answer plain text such as "Service Unavailable": report that as a retryable error.
        text = e.read().decode(errors="replace")
        try:
            body = json.loads(text)
        except ValueError:
            raise RuntimeError(f"HTTP {e.code} from {url}: {text.strip()[:200]}") from e
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]


# --- expositions -------------------------------------------------------------------------


def check_exposition(name, addr, node, fail):
    text = http_get(f"http://{addr}/metrics")
    families = list(text_string_to_metric_families(text))
    samples = sum(len(f.samples) for f in families)
    if not samples:
        fail.add(f"{name} /metrics at {addr} parsed to no samples")
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    findings = [line for line in (lint.stdout + lint.stderr).splitlines() if line.strip()]
    colons = [line for line in findings if COLON_WARNING.match(line)] if node else []
    findings = [line for line in findings if line not in colons]
    # promtool exits 3 for lint findings only, 1 when it cannot parse the input at all.
    if lint.returncode not in (0, 3) or findings:
        fail.add(f"promtool check metrics on {name} ({addr}): rc {lint.returncode}: {findings}")
    allowed = f" apart from {len(colons)} warnings on vLLM's names" if node else ""
    print(f"ok   {name} {addr}: {len(families)} families, {samples} samples parse; promtool clean{allowed}")


def expositions(args):
    fail = Failures()
    check_exposition("router", args.router_metrics, False, fail)
    for addr in args.node_metrics:
        check_exposition("node", addr, True, fail)
    fail.exit(1 + len(args.node_metrics) - len(fail.items))


# --- scrapes -----------------------------------------------------------------------------


def wait_scraped(args):
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            targets = api(args.prometheus, "targets")["activeTargets"]
            up = [t for t in targets if t["health"] == "up"]
            if len(targets) == args.targets and len(up) == args.targets:
                print(f"ok   Prometheus scrapes {len(up)} targets, all up")
                return
            state = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
        except (OSError, RuntimeError) as e:
            state = str(e)
        if time.monotonic() > deadline:
            sys.exit(f"Prometheus targets not all up after {args.timeout}s: {state}")
        time.sleep(0.5)


# --- queries -----------------------------------------------------------------------------


def dashboard_panels(panels):
    for p in panels:
        yield p
        yield from dashboard_panels(p.get("panels", []))


def label_values_query(q):
    """label_values(selector, label) -> (selector, label); label_values(label) -> (None, label)."""
    m = re.fullmatch(r"\s*label_values\((?:(.*),)?\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q)
    if not m:
        raise ValueError(f"unsupported template query {q!r}")
    return (m.group(1).strip() if m.group(1) else None), m.group(2)


def substitute(expr, variables):
    for k, v in INTERVALS.items():
        expr = expr.replace(k, v)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    if "$" in expr:
        raise ValueError(f"unsubstituted variable in {expr!r}")
    return expr


def resolve_variables(prom, dash, fail):
    """Each query variable's values from Prometheus, resolved in order (later ones may use
    earlier ones). Returns the 'All' selection and a selection of one real value each."""
    every, one = {}, {}
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        selector, label = label_values_query(query)
        params = {"match[]": substitute(selector, one)} if selector else {}
        values = api(prom, f"label/{label}/values", **params)
        if not values:
            fail.add(f"dashboard variable {v['name']}: {query} has no values")
            values = [""]
        print(f"ok   variable {v['name']} = {values}")
        every[v["name"]] = v.get("allValue") or "|".join(re.escape(x) for x in values)
        # A regex inside a PromQL string: its backslashes are escaped once more.
        one[v["name"]] = re.escape(values[0]).replace("\\", "\\\\")
    return every, one


def is_ratio(unit_or_name):
    return unit_or_name in ("percentunit",) or "ratio" in unit_or_name


def check_values(what, result, ratio, fail):
    values = [float(s["value"][1]) for s in result]
    if ratio and any(math.isnan(x) or x < 0 or x > 1 for x in values):
        fail.add(f"{what}: hit ratio outside [0, 1]: {values}")
        return False
    return True


def queries(args):
    prom, at = args.prometheus, args.time or time.time()
    fail = Failures()
    passed = 0

    def evaluate(what, expr, need_data, ratio):
        nonlocal passed
        try:
            result = api(prom, "query", query=expr, time=at)["result"]
        except RuntimeError as e:
            fail.add(f"{what}: {e}\n     {expr}")
            return None
        if need_data and not result:
            fail.add(f"{what}: no data\n     {expr}")
            return result
        if check_values(what, result, ratio, fail):
            passed += 1
        return result

    for path in DASHBOARDS:
        dash = json.load(open(path))
        selections = resolve_variables(prom, dash, fail)
        for p in dashboard_panels(dash["panels"]):
            unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            for t in p.get("targets", []):
                for label, variables in zip(("all", "one"), selections):
                    what = f"{os.path.basename(path)} panel {p['title']!r} {t['refId']} ({label})"
                    evaluate(what, substitute(t["expr"], variables), True, is_ratio(unit))
        print(f"ok   {os.path.basename(path)}: every panel query evaluated")

    for path in RULE_FILES:
        for group in yaml.safe_load(open(path))["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    name = rule["record"]
                    evaluate(f"recording rule {name}", rule["expr"], True, is_ratio(name))
                    # The series Prometheus itself recorded (evaluation_interval 1s).
                    evaluate(f"recorded series {name}", name, True, is_ratio(name))
                else:
                    firing = evaluate(f"alert {rule['alert']}", rule["expr"], False, False)
                    if firing:
                        print(f"note alert {rule['alert']} condition holds: {firing}")
        print(f"ok   {os.path.basename(path)}: every rule expression evaluated")

    for group in api(prom, "rules")["groups"]:
        for rule in group["rules"]:
            if rule.get("health") != "ok":
                fail.add(f"rule {rule['name']} in Prometheus: {rule.get('health')} {rule.get('lastError')}")
            else:
                passed += 1

    def by_role(query, t):
        result = api(prom, "query", query=f"sum by (role) ({query})", time=t)["result"]
        return {s["metric"].get("role"): float(s["value"][1]) for s in result}

    # The load is over: the router's aggregates must settle on exactly the nodes' own totals
    # (both scraped by the same Prometheus). Allow a few scrapes and Info polls to get there.
    for router, node in ROUTER_VS_NODES:
        deadline = time.monotonic() + 15
        while True:
            t = time.time()
            rv, nv = by_role(router, t), by_role(node, t)
            if (rv and rv == nv) or time.monotonic() > deadline:
                break
            time.sleep(1)
        if not rv or rv != nv:
            fail.add(f"router {router} {rv} != nodes' {node} {nv}")
        else:
            passed += 1
            print(f"ok   {router} = sum of nodes' {node}: {rv}")

    # The load repeats a hot prefix (local hits) and cycles others through a KV pool too small
    # for them (restored from the host tier: external hits). Both must show at the router.
    for cache in ("local", "external"):
        query = f'sum(pd_router_prefix_cache_hits_total{{cache="{cache}",role="prefill"}})'
        hits = api(prom, "query", query=query, time=at)["result"]
        if not hits or float(hits[0]["value"][1]) <= 0:
            fail.add(f"the load made no {cache} prefix-cache hit on the prefill nodes: {hits}")
        else:
            passed += 1

    models = api(prom, "label/model_name/values", **{"match[]": "vllm:num_requests_running"})
    if args.model not in models:
        fail.add(f"label_values(vllm:num_requests_running, model_name) = {models}, no {args.model!r}")
    else:
        passed += 1
        print(f"ok   label_values(vllm:num_requests_running, model_name) = {models}")
    fail.exit(passed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("expositions")
    e.add_argument("--router-metrics", required=True)
    e.add_argument("--node-metrics", nargs="+", required=True)
    w = sub.add_parser("wait-scraped")
    w.add_argument("--prometheus", required=True)
    w.add_argument("--targets", type=int, required=True)
    w.add_argument("--timeout", type=float, default=60)
    q = sub.add_parser("queries")
    q.add_argument("--prometheus", required=True)
    q.add_argument("--model", required=True)
    q.add_argument("--time", type=float, help="evaluation time (default: now)")
    args = ap.parse_args()
    {"expositions": expositions, "wait-scraped": wait_scraped, "queries": queries}[args.command](args)


if __name__ == "__main__":
    main()
