#!/usr/bin/env bash
# Installs kvpress 0.5.5 (the kvpress rows of run.py) into a venv, without its transformers pin.
#   bench/quality/install_kvpress.sh build/pyenv/bin/python
# kvpress 0.5.5 requires transformers < 5.3; a plain `pip install kvpress` downgrades the venv to
# transformers 5.2, whose GGUF loader builds Gemma's tokenizer as a Unigram model and cuts words
# into fragments (run.py refuses it; README.md: "Gemma 3's tokenizer"). transformers 5.18 and
# later build it right, and kvpress's presses run on 5.24 as on 5.2 (README.md). So kvpress goes
# in with --no-deps, and then its other requirements, read from its own metadata (pip then warns
# that kvpress requires transformers < 5.3: expected).
set -euo pipefail
py=${1:?usage: bench/quality/install_kvpress.sh VENV_PYTHON}
pip=("$py" -m pip install --disable-pip-version-check --no-input -q)
"${pip[@]}" --no-deps "kvpress==0.5.5"
"$py" - <<'PY' | xargs -r -d '\n' "${pip[@]}"
from importlib.metadata import requires
for req in requires("kvpress"):
    if "extra ==" not in req and not req.startswith("transformers"):
        print(req)
PY
"$py" -c "from importlib.metadata import version; print('kvpress', version('kvpress'), 'with transformers', version('transformers'))"
