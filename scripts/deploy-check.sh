#!/usr/bin/env bash
# Checks deploy/ without a Kubernetes cluster: what a cluster, Prometheus or our binaries
# would reject. Renders every overlay with `kubectl kustomize`, validates the output with
# kubernetes-validate --strict, lints all YAML, runs every container's command line through the
# matching binary's --check-config, checks the PrometheusRule with promtool, and that the
# generated copies under deploy/k8s/base/generated match their sources.
# Needs the debug binaries (cargo build --workspace --bins) and promtool (prometheus-check.sh
# installs it).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    kubernetes-validate==1.37.0 yamllint==1.38.0 >/dev/null
if ! command -v kubectl >/dev/null; then
    echo "kubectl (with its built-in kustomize v5) is needed to render deploy/k8s" >&2
    exit 1
fi

echo "== generated copies are up to date"
./deploy/k8s/sync.sh --check

echo "== yamllint"
yamllint -c .yamllint.yaml deploy/

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for overlay in deploy/k8s/overlays/*/; do
    name="$(basename "$overlay")"
    echo "== overlay $name"
    kubectl kustomize "$overlay" >"$out/$name.yaml"
    # Exits non-zero on any error; our two Prometheus Operator kinds and cert-manager's two
    # have no schema there (only a warning); the first two are checked below instead.
    kubernetes-validate --strict --quiet "$out/$name.yaml" 2>&1 \
        | { grep -v "Couldn't find schema for kind \(PodMonitor\|PrometheusRule\|Certificate\|Issuer\) " || true; } \
        || { echo "kubernetes-validate failed on overlay $name" >&2; exit 1; }
    python3 tools/deploy/check_manifests.py --bin-dir target/debug "$out/$name.yaml"
    python3 - "$out/$name.yaml" "$out/$name-rules.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
rules = [d for d in docs if d["kind"] == "PrometheusRule"]
assert len(rules) == 1, f"expected one PrometheusRule, found {len(rules)}"
yaml.safe_dump({"groups": rules[0]["spec"]["groups"]}, open(sys.argv[2], "w"))
PY
    promtool check rules "$out/$name-rules.yaml"
done
echo "deploy checks passed"
