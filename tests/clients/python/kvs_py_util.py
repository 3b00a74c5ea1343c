"""Helpers shared by the Python client tests (imported by name; pytest puts this folder on
sys.path)."""

import time

import numpy as np

import kvsidecar as kvs


def wait_for(predicate, timeout=20.0, interval=0.02):
    """Polls `predicate` until it is true or `timeout` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def layout(dtype="fp16", num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=16,
           block_tokens=16):
    return kvs.model_layout(num_layers=num_layers, num_kv_heads=num_kv_heads,
                            num_q_heads=num_q_heads, head_dim=head_dim, dtype=dtype,
                            block_tokens=block_tokens)


def random_kv(dtype, shape, seed=0):
    """Random K/V in the storage dtype of `dtype` ("fp16", "bf16", "fp32")."""
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    if dtype == "bf16":
        return kvs.float32_to_bf16(values)
    return values.astype(np.float16 if dtype == "fp16" else np.float32)



