"""kvsidecar: Python client of the kvsidecar KV-cache service.

Quick start::

    import numpy as np
    import kvsidecar as kvs

    with kvs.Client("127.0.0.1:50051") as client, \\
            client.attach(kvs.model_layout(num_layers=2, num_kv_heads=2, head_dim=64,
                                           dtype="fp16")) as session:
        seq = session.create_sequence(policy="keydiff", budget=32).sequence_id
        r = session.reserve(seq, 100)
        for layer in range(2):
            r.write(layer, k=np.random.randn(2, 100, 64), v=np.random.randn(2, 100, 64))
        session.commit(r)
        session.compress(seq)
        kv = session.read_layer(session.get_layout(seq), layer=0)   # K, V [H][32][D], in place

Modules: :mod:`kvsidecar.client` (Client, Session), :mod:`kvsidecar.admin` (Admin),
:mod:`kvsidecar.arena` (block layout, dtypes, the mapped arena), :mod:`kvsidecar.errors`
(KvsError hierarchy), :mod:`kvsidecar.credentials` (TLS / mutual TLS), :mod:`kvsidecar.v1`
(generated protobuf/gRPC stubs).
"""

from kvsidecar import errors
from kvsidecar.admin import Admin
from kvsidecar.arena import (Arena, CudaArena, bf16_to_float32, dtype_bytes, float32_to_bf16,
                             fetch_arena_fd, open_arena, storage_dtype, to_float32, to_storage)
from kvsidecar.client import (QUERY_AGNOSTIC_POLICIES, AppendSegment, Client, DecodeItem,
                              ExportResult, LayerKV, Reservation, ReserveItem, Session, Tier,
                              attention, budget, model_layout, policy, prefix_key,
                              staged_attention)
from kvsidecar.credentials import tls_credentials
from kvsidecar.errors import KvsError
from kvsidecar.v1 import admin_pb2, common_pb2, sidecar_pb2

__version__ = "0.1.0"

__all__ = [
    "Admin", "AppendSegment", "Arena", "Client", "CudaArena", "open_arena", "DecodeItem", "ExportResult", "KvsError",
    "LayerKV", "Reservation", "ReserveItem", "Session", "Tier", "admin_pb2", "attention",
    "staged_attention",
    "bf16_to_float32", "budget", "common_pb2", "dtype_bytes", "errors", "float32_to_bf16",
    "model_layout", "policy", "sidecar_pb2", "storage_dtype", "tls_credentials", "to_float32",
    "to_storage", "fetch_arena_fd", "prefix_key", "QUERY_AGNOSTIC_POLICIES",
]
