#!/usr/bin/env bash
# Packs what a GPU machine that has no build dependencies needs to run kvsidecar's CUDA checks
# (deploy/gpu/check.sh) into one archive: a Release CUDA build for sm_80 and sm_90, stripped —
# kvsidecar, kvs_demo, cuda_bench, service_bench, rpc_counts, the CUDA test programs and every test program
# with /cuda runs — the shared libraries they need from this machine (ldd; the system C/C++ runtime,
# the CUDA driver and cuBLAS come from the device), manifest.json (the selected ctest entries with
# this machine's paths replaced, for deploy/gpu/run_tests.py), and the Python client as a wheel with
# its generated gRPC stubs plus the grpcio and protobuf wheels it was generated for (Python 3.12).
#
#   deploy/gpu/bundle.sh                       # configure + build build-gpu (Release, CUDA), pack
#   deploy/gpu/bundle.sh --build-dir DIR --no-build --no-wheel --compress none --out FILE
#
# Options:
#   --build-dir DIR   build directory (default build-gpu); configured here if it has no CMakeCache
#   --no-build        take DIR as it is (a build without CUDA gives a bundle without CUDA programs)
#   --out FILE        the archive (default .gpu/kvs-gpu-bundle.tar.xz; .gpu/ is git-ignored and
#                     travels with the device tool's `carry`)
#   --compress xz|none  xz (default; one stream with a large dictionary, so the CUDA kernels every
#                     test program carries compress once) or a plain tar (tests)
#   --no-wheel        no Python wheels (they need PyPI: setuptools, grpcio-tools, grpcio, protobuf)
#   --keep-stage DIR  also leave the unpacked bundle in DIR (replaced if present)
# Prints the archive path and its size. Exit 1 if the bundle is not self-contained (verify).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here="$root/deploy/gpu"
build="$root/build-gpu"
out="$root/.gpu/kvs-gpu-bundle.tar.xz"
do_build=1
compress=xz
wheel=1
keep=""
# The versions the stubs are generated for (clients/python/pyproject.toml): protobuf 5.x gencode.
grpcio_version=${KVS_BUNDLE_GRPCIO:-1.66.2}
protobuf_version=${KVS_BUNDLE_PROTOBUF:-5.29.6}

while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build=$(realpath -m "$2"); shift 2 ;;
    --no-build) do_build=0; shift ;;
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --compress) compress=$2; shift 2 ;;
    --no-wheel) wheel=0; shift ;;
    --keep-stage) keep=$(realpath -m "$2"); shift 2 ;;
    *) sed -n '2,22p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
  esac
done
case "$compress" in xz|none) ;; *) echo "bundle.sh: --compress xz or none" >&2; exit 2 ;; esac

if [ "$do_build" = 1 ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    [ -x "$nvcc" ] || { echo "bundle.sh: nvcc not found (PATH, /usr/local/cuda/bin)" >&2; exit 1; }
    launcher=()
    if command -v ccache >/dev/null; then
      launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
                -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    fi
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVS_WITH_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="80;90" "${launcher[@]}" >&2
  fi
  mapfile -t targets < <(python3 "$here/bundle_tool.py" targets "$build")
  cmake --build "$build" -j "${KVS_BUNDLE_JOBS:-2}" --target "${targets[@]}" >&2
fi
[ -f "$build/CMakeCache.txt" ] || { echo "bundle.sh: $build is not a build directory" >&2; exit 1; }

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvs-bundle-XXXXXX")
trap 'rm -rf "$stage"' EXIT
top="$stage/kvs-gpu-bundle"
mkdir -p "$top"
python3 "$here/bundle_tool.py" stage "$build" "$root" "$top" >&2

if [ "$wheel" = 1 ]; then
  mkdir -p "$top/python"
  # The client wheel: pip builds it in isolation (grpcio-tools generates the stubs into it).
  python3 -m pip wheel --disable-pip-version-check -q --no-deps -w "$top/python" \
    "$root/clients/python" >&2
  rm -rf "$root/clients/python/build"
  python3 -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$top/python" \
    "grpcio==$grpcio_version" "protobuf==$protobuf_version" >&2
  contents=$(unzip -l "$top/python"/kvsidecar-*.whl)
  grep -q 'kvsidecar/v1/sidecar_pb2_grpc.py' <<<"$contents" ||
    { echo "bundle.sh: the client wheel has no generated stubs" >&2; exit 1; }
fi

python3 "$here/bundle_tool.py" verify "$top" >&2

mkdir -p "$(dirname "$out")"
rm -f "$out"
if [ "$compress" = xz ]; then
  # Sorted by name so that copies of the same kernels sit near each other in the stream.
  tar -C "$stage" --sort=name -cf - kvs-gpu-bundle |
    xz -T1 --lzma2=preset=9,dict=256MiB >"$out"
else
  tar -C "$stage" --sort=name -cf "$out" kvs-gpu-bundle
fi
if [ -n "$keep" ]; then
  rm -rf "$keep"
  mv "$top" "$keep"
fi
echo "$out $(stat -c %s "$out") bytes"
