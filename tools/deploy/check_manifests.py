#!/usr/bin/env python3
"""Checks rendered Kubernetes manifests the way a cluster (and our binaries) would.

For every container of every workload in a rendered overlay: run the container's binary
(built in this checkout) with `--check-config` plus the manifest's args and environment
(ConfigMap `envFrom` resolved, `$(VAR)` references expanded as the kubelet does), so a
flag or value a binary does not accept fails the build. Also checks what
kubernetes-validate cannot (it has no schema for Prometheus Operator kinds): the
PodMonitor's shape and its port names against the pods, and that probes, preStop and grace
periods agree with the nodes' drain.

Usage: check_manifests.py --bin-dir target/debug RENDERED.yaml...
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
POD_IP = "10.0.0.7"


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def expand(value, env):
    # The kubelet expands $(VAR) from the container's env; $$(VAR) escapes.
    return re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env.get(m.group(1), m.group(0)), value)


def secret_standins(bin_dir):
    """A directory per Secret kind the base mounts: certificates from `pdctl certs` (named as
    cert-manager names them) and an API keys file."""
    root = tempfile.mkdtemp(prefix="pd-deploy-check-")
    made = os.path.join(root, "made")
    subprocess.run([os.path.join(bin_dir, "pdctl"), "certs", "--out", made,
                    "--hosts", "pd-node,pd-router,pd-metrics"],
                   check=True, capture_output=True, text=True, timeout=60)
    tls = os.path.join(root, "tls")
    os.makedirs(tls)
    for src, dst in (("node.crt", "tls.crt"), ("node.key", "tls.key"), ("ca.crt", "ca.crt")):
        shutil.copy(os.path.join(made, src), os.path.join(tls, dst))
    keys = os.path.join(root, "api-keys")
    os.makedirs(keys)
    with open(os.path.join(keys, "api-keys"), "w") as f:
        f.write("# tenant key\nteam-a sk-deploy-check-0123456789abcdef\n")
    return {"tls": tls, "api-keys": keys}


def secret_mounts(spec, container, standins, where):
    """Mount path -> local stand-in directory, for each Secret volume the container mounts."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", [])
               if "secret" in v}
    out = {}
    for m in container.get("volumeMounts", []):
        if m["name"] not in secrets:
            continue
        if m["name"] not in standins:
            fail(f"{where}: mounts Secret volume {m['name']!r}, which this check cannot stand in for")
        if not m.get("readOnly"):
            fail(f"{where}: Secret volume {m['name']!r} must be mounted readOnly")
        out[m["mountPath"].rstrip("/")] = standins[m["name"]]
    return out


def check_probe(probe, where, name):
    if "grpc" in probe:
        return
    get = probe.get("httpGet")
    if get and get.get("path") == "/health" and get.get("port") == "metrics":
        return
    fail(f"{where}: {name} must be a gRPC probe (grpc.health.v1) or GET /health on the "
         f"metrics port (with TLS on, the kubelet's gRPC probes cannot connect)")


def container_env(container, configmaps):
    env = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref is None:
            fail(f"envFrom without configMapRef in {container['name']}")
        name = ref["name"]
        if name not in configmaps:
            fail(f"container {container['name']} reads ConfigMap {name}, which is not in the overlay")
        env.update(configmaps[name])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
        else:
            fail(f"env {var['name']} of {container['name']}: unsupported valueFrom")
    return env


def check_workload(doc, configmaps, bin_dir, path, standins):
    spec = doc["spec"]["template"]["spec"]
    grace = spec.get("terminationGracePeriodSeconds", 30)
    for c in spec["containers"]:
        where = f"{path}: {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
        command = c.get("command")
        if not command or len(command) != 1:
            fail(f"{where}: command must name exactly one of our binaries")
        binary = os.path.join(bin_dir, command[0])
        if not os.path.exists(binary):
            fail(f"{where}: no binary {command[0]} in {bin_dir}")
        env = container_env(c, configmaps)
        for mount, local in secret_mounts(spec, c, standins, where).items():
            env = {k: v.replace(mount + "/", local + "/") for k, v in env.items()}
        args = [expand(a, env) for a in c.get("args", [])]
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("PD_")}
        run_env.update(env)
        proc = subprocess.run([binary, "--check-config", *args], env=run_env,
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            fail(f"{where}: `{command[0]} --check-config {' '.join(args)}` exited "
                 f"{proc.returncode}:\n{proc.stdout}{proc.stderr}")
        print(f"ok   {where}: {command[0]} --check-config accepted {len(args)} args")
        ports = {p["name"] for p in c.get("ports", [])}
        for need in ("grpc", "metrics"):
            if need not in ports:
                fail(f"{where}: no container port named {need!r}")
        for probe in ("readinessProbe", "livenessProbe"):
            check_probe(c.get(probe, {}), where, probe)
        drain = float(env.get("PD_DRAIN_TIMEOUT", "30"))
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        if command[0] != "router" and grace < drain + pre_stop:
            fail(f"{where}: terminationGracePeriodSeconds {grace} < preStop {pre_stop} s + "
                 f"drain {drain} s: the kubelet would kill a draining node")
        sc = c.get("securityContext", {})
        pod_sc = spec.get("securityContext", {})
        if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
            fail(f"{where}: must run as non-root")
    return {p["name"] for c in spec["containers"] for p in c.get("ports", [])}


def selects(selector, labels):
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] != "In":
            fail(f"NetworkPolicy selector operator {e['operator']} is not checked here")
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def check_networkpolicy(doc, workloads, path):
    name = doc["metadata"]["name"]
    pods = [w for w in workloads
            if selects(doc["spec"]["podSelector"], w["spec"]["template"]["metadata"]["labels"])]
    if not pods:
        fail(f"{path}: NetworkPolicy {name} selects no pod")
    for rule in doc["spec"].get("ingress", []):
        for port in rule.get("ports", []):
            for w in pods:
                named = {p["name"] for c in w["spec"]["template"]["spec"]["containers"]
                         for p in c.get("ports", [])}
                if port["port"] not in named:
                    fail(f"{path}: NetworkPolicy {name} opens port {port['port']!r}, which "
                         f"{w['metadata']['name']} does not name")
        for peer in rule.get("from", []):
            if "podSelector" in peer and not any(
                    selects(peer["podSelector"], w["spec"]["template"]["metadata"]["labels"])
                    for w in workloads):
                fail(f"{path}: NetworkPolicy {name} admits pods that no workload has")
    print(f"ok   {path}: NetworkPolicy {name} selects {[w['metadata']['name'] for w in pods]}")


def used_metric_names(docs):
    """Series names the rules and the dashboard read (recording rules' own names excluded)."""
    text, recorded = "", set()
    for d in docs:
        if d["kind"] == "PrometheusRule":
            for group in d["spec"]["groups"]:
                for rule in group["rules"]:
                    text += " " + str(rule["expr"])
                    if "record" in rule:
                        recorded.add(rule["record"])
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pd-grafana-dashboard":
            text += " " + " ".join(d.get("data", {}).values())
    names = set(re.findall(r"\b(vllm:[a-z0-9_:]+|pd_[a-z0-9_:]+)", text))
    # Recording rules follow level:metric:operations (colons); a trailing "_" is a prefix
    # written in prose or a regex, not a series.
    return {n for n in names
            if n not in recorded and not n.endswith("_")
            and (n.startswith("vllm:") or ":" not in n)}


def check_podmonitor(doc, port_names, path, docs):
    endpoints = doc["spec"].get("podMetricsEndpoints", [])
    if not endpoints:
        fail(f"{path}: PodMonitor without podMetricsEndpoints")
    allowed = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings",
               "scheme", "honorLabels", "tlsConfig"}
    for ep in endpoints:
        unknown = set(ep) - allowed
        if unknown:
            fail(f"{path}: PodMonitor endpoint has unknown fields {sorted(unknown)}")
        if ep.get("port") not in port_names:
            fail(f"{path}: PodMonitor scrapes port {ep.get('port')!r}, which no pod names")
        for relabel in ep.get("metricRelabelings", []):
            if relabel.get("action") == "keep" and relabel.get("sourceLabels") == ["__name__"]:
                keep = re.compile(relabel["regex"])
                dropped = sorted(n for n in used_metric_names(docs) if not keep.fullmatch(n))
                if dropped:
                    fail(f"{path}: the PodMonitor drops series the rules or dashboard read: {dropped}")
    print(f"ok   {path}: PodMonitor scrapes port(s) {[ep['port'] for ep in endpoints]}, "
          f"keeps all {len(used_metric_names(docs))} series names the rules and dashboard read")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("rendered", nargs="+")
    a = ap.parse_args()
    standins = secret_standins(a.bin_dir)
    for path in a.rendered:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs
                      if d["kind"] == "ConfigMap"}
        port_names = set()
        workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
        if not workloads:
            fail(f"{path}: no workloads rendered")
        for d in workloads:
            port_names |= check_workload(d, configmaps, a.bin_dir, path, standins)
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        if not policies:
            fail(f"{path}: no NetworkPolicy rendered")
        for d in policies:
            check_networkpolicy(d, workloads, path)
        for d in docs:
            if d["kind"] == "PodMonitor":
                check_podmonitor(d, port_names, path, docs)


if __name__ == "__main__":
    main()
