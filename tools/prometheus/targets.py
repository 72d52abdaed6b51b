"""Prometheus file_sd target files from `pdctl up`'s ready line.

Usage: python3 tools/prometheus/targets.py READY_JSON OUT_DIR [--shell]

Writes OUT_DIR/router.json (the router's metrics address) and OUT_DIR/nodes.json (every
prefill and decode node's), the files deploy/prometheus/prometheus.yml reads. Prometheus
re-reads them when they change. With --shell, also prints shell assignments for
scripts/prometheus-check.sh: ROUTER_GRPC, ROUTER_METRICS, NODE_METRICS (space-separated),
and TARGETS (how many).
"""

import argparse
import json
import os
import shlex
import urllib.parse


def addresses(ready):
    """(router gRPC, router metrics, [node metrics]) from pdctl up's ready JSON, each metrics
    address as HOST:PORT (a Prometheus target); the ready line's `router_metrics` is a URL."""
    nodes = ready["prefill_metrics"] + ready["decode_metrics"]
    router_metrics = urllib.parse.urlsplit(ready["router_metrics"]).netloc
    return ready["router"], router_metrics, nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ready")
    ap.add_argument("out")
    ap.add_argument("--shell", action="store_true")
    args = ap.parse_args()
    ready = json.load(open(args.ready))
    router, router_metrics, nodes = addresses(ready)
    os.makedirs(args.out, exist_ok=True)
    for name, targets in (("router.json", [router_metrics]), ("nodes.json", nodes)):
        tmp = os.path.join(args.out, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump([{"targets": targets}], f, indent=2)
        # Atomic: Prometheus watches the file and must never read half of it.
        os.replace(tmp, os.path.join(args.out, name))
    if args.shell:
        for key, value in (
            ("ROUTER_GRPC", router),
            ("ROUTER_METRICS", router_metrics),
            ("NODE_METRICS", " ".join(nodes)),
            ("TARGETS", str(1 + len(nodes))),
        ):
            print(f"{key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
