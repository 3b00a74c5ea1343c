#!/usr/bin/env bash
# Building the Python client leaves its source tree as it was: pip builds a wheel from a copy of
# clients/python and proto/ (the layout setup.py expects), and afterwards the copy holds exactly
# the files it held before (no build/, no *.egg-info, no generated stubs). The wheel must carry
# the typed stubs (py.typed, *_pb2.pyi, *_pb2_grpc.pyi) that `mypy --strict` relies on.
#   tests/clients/python/install_clean_test.sh PYTHON    # a venv's python with pip
# pip's cache serves the build requirements after the first run; PyPI is needed for that one.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
py=${1:?usage: install_clean_test.sh PYTHON}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvs-install-clean-XXXXXX")
trap 'rm -rf "$work"' EXIT

# The tracked files only: what a fresh checkout holds.
mkdir -p "$work/src"
(cd "$root" && git ls-files -z -- clients/python proto | xargs -0 cp --parents -t "$work/src")
(cd "$work/src" && find . | sort) >"$work/before.txt"

"$py" -m pip wheel --disable-pip-version-check --no-input -q --no-deps -w "$work/wheel" \
  "$work/src/clients/python" >"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; exit 1; }

failures=0
(cd "$work/src" && find . | sort) >"$work/after.txt"
if ! diff -u "$work/before.txt" "$work/after.txt" >"$work/diff.txt"; then
  echo "FAIL: building the wheel changed the source tree:" >&2
  grep '^[-+]\./' "$work/diff.txt" | head -20 >&2
  failures=$((failures + 1))
else
  echo "ok   the source tree is unchanged after pip wheel ($(wc -l <"$work/before.txt") entries)"
fi

wheel=$(ls "$work"/wheel/kvsidecar-*.whl)
"$py" - "$wheel" <<'PY' || failures=$((failures + 1))
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = ["kvsidecar/py.typed"] + [f"kvsidecar/v1/{p}_pb2{k}" for p in ("common", "sidecar", "admin")
                                 for k in (".py", ".pyi", "_grpc.py", "_grpc.pyi")]
missing = [n for n in want if n not in names]
if missing:
    print(f"FAIL: the wheel lacks {missing}", file=sys.stderr)
    sys.exit(1)
print(f"ok   the wheel carries py.typed and the typed stubs ({len(want) - 1} generated files)")
PY

if [ "$failures" -ne 0 ]; then
  echo "install clean: $failures failure(s)" >&2
  exit 1
fi
echo "install clean: 2 passed, 0 failed"
