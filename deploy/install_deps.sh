#!/usr/bin/env bash
# Installs every build and test dependency of kvsidecar from Debian packages (bookworm).
# Idempotent: does nothing when everything is already installed. Needs root or sudo.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev libgtest-dev libgmock-dev libbenchmark-dev
  libyaml-cpp-dev libcpp-httplib-dev openssl
  libcli11-dev
)
# Prometheus metrics (service/metrics.h).
packages+=(prometheus-cpp-dev)
# The remote tier on Redis (storage/redis/): the hiredis client, and redis-server / redis-cli /
# redis-benchmark for its tests and benchmark.
packages+=(libhiredis-dev redis-server redis-tools)
# libfaketime: tests/e2e/reclaim_test steps the system clock of a server and of a worker under it.
packages+=(libfaketime)
# tests/deploy: a venv for kubernetes-validate, and kubectl to render the Kubernetes manifests.
# They need kubectl 1.22+ (kustomize `labels`). Debian's kubernetes-client (1.20) only when none
# is installed (another kubectl package would conflict with it); the test then asks for a newer
# one.
# python3-venv is also what deploy/python_env.sh needs for the Python client's venv (build/pyenv).
packages+=(python3-venv)
command -v kubectl >/dev/null 2>&1 || packages+=(kubernetes-client)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done"
