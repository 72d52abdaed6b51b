#!/usr/bin/env bash
# The shipped dashboard and Prometheus rules against a real Prometheus scraping a live local
# cluster under load (docs/metrics.md). Needs the workspace binaries built
# (target/debug). Installs Debian's `prometheus` package when promtool/prometheus are missing
# (binaries only: the system service is never started; this script runs its own Prometheus on
# a free 127.0.0.1 port with a temporary data directory) and a few pinned Python packages.
#
# 1. promtool: rule syntax, rule unit tests (deploy/prometheus/tests), the shipped config;
# 2. `pdctl up` (1 prefill + 1 decode node, synthetic:tiny, a small KV pool with a host tier),
#    the router's and nodes' /metrics
#    through `promtool check metrics` and prometheus_client's parser;
# 3. Prometheus with deploy/prometheus/prometheus.yml (scrape and rule interval cut to 1 s)
#    scraping every metrics address of `pdctl up`'s ready line;
# 4. load with shared prefixes, an abort and a bad request (tools/prometheus/load.py);
# 5. every PromQL expression of deploy/grafana/*.json and deploy/prometheus/*.yml through
#    /api/v1/query (tools/prometheus/check_live.py);
# 6. the nodes' encoder against metrics-exporter-prometheus (docs/metrics.md, "Encoders"): the
#    nodes' /metrics recorded during the load, the same series rendered by the exporter
#    (node-common/examples/exporter_twin.rs), both replayed to real Prometheus instances and
#    every dashboard, rule and vLLM dashboard expression compared (tools/prometheus/encoders.py).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "== installing Debian's prometheus package (the service is not started)"
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    # policy-rc.d exiting 101 forbids maintainer scripts to start services.
    created_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
        $sudo chmod +x /usr/sbin/policy-rc.d
        created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
        || { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
    [ -z "$created_policy" ] || $sudo rm -f /usr/sbin/policy-rc.d
fi
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    prometheus-client==0.26.0 pyyaml==6.0.3 \
    grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 >/dev/null

echo "== promtool: rules, rule unit tests"
promtool check rules deploy/prometheus/*.rules.yml deploy/prometheus/*.alerts.yml
promtool test rules deploy/prometheus/tests/*.yml

echo "== the cluster tests that need promtool (#[ignore]d in cargo test: run with --ignored)"
cargo test --locked -p pd-tests --test metrics -- --ignored

work="$(mktemp -d)"
pids=()
cleanup() {
    # Prometheus first, then pdctl up (it stops the router, then drains the nodes).
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill -TERM "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

echo "== local cluster (pdctl up)"
model="synthetic:tiny"
ready="$work/ready.json"
# A small KV pool with a host tier: the load's prefixes do not all fit, so the prefill node
# also restores evicted ones from host memory (external hits), not only local hits.
PD_CACHE_DIR="$work/cache" RUST_LOG=warn ./target/debug/pdctl up --model "$model" \
    -- --num-gpu-blocks 48 --host-cache-blocks 512 >"$ready" &
pids+=($!)
for _ in $(seq 1 600); do
    [ -s "$ready" ] && break
    kill -0 "${pids[0]}" 2>/dev/null || { echo "pdctl up exited before it was ready" >&2; exit 1; }
    sleep 0.2
done
[ -s "$ready" ] || { echo "pdctl up was not ready in 120 s" >&2; exit 1; }
cat "$ready"

# Prometheus config: the shipped one, its rule files beside it, targets from the ready line.
prom="$work/prometheus"
mkdir -p "$prom"
cp deploy/prometheus/prometheus.yml deploy/prometheus/*.rules.yml deploy/prometheus/*.alerts.yml "$prom/"
sed -i -E 's/^(  (scrape|evaluation)_interval:) 5s$/\1 1s/' "$prom/prometheus.yml"
[ "$(grep -cE '^  (scrape|evaluation)_interval: 1s$' "$prom/prometheus.yml")" -eq 2 ] \
    || { echo "deploy/prometheus/prometheus.yml: no 5s scrape/evaluation interval to shorten" >&2; exit 1; }
eval "$(python3 tools/prometheus/targets.py "$ready" "$prom/targets" --shell)"
promtool check config "$prom/prometheus.yml"

echo "== /metrics expositions (promtool check metrics, prometheus_client parser)"
# shellcheck disable=SC2086 # NODE_METRICS is a list of addresses
python3 tools/prometheus/check_live.py expositions \
    --router-metrics "$ROUTER_METRICS" --node-metrics $NODE_METRICS

echo "== Prometheus scraping the cluster"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
prometheus --config.file="$prom/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$port" --log.level=warn >"$work/prometheus.log" 2>&1 &
pids+=($!)
url="http://127.0.0.1:$port"
python3 tools/prometheus/check_live.py wait-scraped --prometheus "$url" --targets "$TARGETS" \
    || { cat "$work/prometheus.log" >&2; exit 1; }

echo "== load (the nodes' /metrics recorded meanwhile for step 6)"
encoders="$work/encoders"
mkdir -p "$encoders"
# shellcheck disable=SC2086 # NODE_METRICS is a list of addresses
python3 tools/prometheus/encoders.py record --node-metrics $NODE_METRICS \
    --out "$encoders/nodes" --stop-file "$encoders/stop" &
pids+=($!)
python3 tools/prometheus/load.py "$ROUTER_GRPC"
# Let the router apply the last counter reports (Info poll), Prometheus scrape them and
# evaluate the rules on them.
sleep 4
touch "$encoders/stop"

echo "== every dashboard and rule expression through Prometheus"
python3 tools/prometheus/check_live.py queries --prometheus "$url" --model "$model"

echo "== the nodes' encoder against metrics-exporter-prometheus (docs/metrics.md)"
cargo run --quiet --locked -p pd-node --example exporter_twin -- "$encoders/nodes" "$encoders/exporter"
python3 tools/prometheus/encoders.py compare --a "$encoders/nodes" --b "$encoders/exporter"
