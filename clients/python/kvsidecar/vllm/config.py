"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

=================  =============================================================================
key                meaning
=================  =============================================================================
address            the sidecar's data plane, ``host:port`` (default ``127.0.0.1:50051``)
token_file         file whose first line is the tenant's bearer token (sidecar with
                   ``--tenant_tokens_file``); none = an open data plane
tenant             tenant named at Attach when the sidecar has no tokens (default: the sidecar's)
policy             ``none`` (default): prefixes stored whole, block by block; or a query-agnostic
                   policy (``keydiff``, ``streaming_llm``, ``knorm``), or ``snapkv`` with
                   ``window``: prefixes stored compressed
budget             with a policy: kept tokens per layer, ``"25%"`` of the prefix or a count
window             snapkv only: its observation window W (default 32), the prefix's last W
                   tokens, whose queries choose what is kept; part of the key, so a prefix
                   compressed for one window of queries serves only prompts with the same ones
tier               where copies go: ``host``, ``disk``, ``remote`` (``redis``), or empty for the
                   sidecar's default (remote when it has one, else disk)
model_id           what names the model in the keys (default: vLLM's model name or path); engines
                   that share prefixes must agree on it
num_blocks         blocks of the session's arena (default: enough for one max-length prompt)
timeout            seconds per sidecar call (default 10)
load_delay_s       failure tests only: wait this long before each load
=================  =============================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from kvsidecar.client import QUERY_AGNOSTIC_POLICIES
from kvsidecar.v1 import common_pb2
from kvsidecar.vllm.store import TIERS

COMPRESSING_POLICIES = tuple(QUERY_AGNOSTIC_POLICIES) + ("knorm",)
WINDOW_POLICIES = ("snapkv",)
_KEYS = ("address", "token_file", "tenant", "policy", "budget", "window", "tier", "model_id",
         "num_blocks", "timeout", "load_delay_s")


@dataclass
class ConnectorConfig:
    address: str = "127.0.0.1:50051"
    token: Optional[str] = None
    tenant: str = ""
    policy: str = "none"
    budget_fraction: Optional[float] = None  # "25%"
    budget_tokens: Optional[int] = None      # 512
    window: int = 0                          # snapkv's observation window
    tier: str = ""
    model_id: str = ""
    num_blocks: int = 0
    timeout: float = 10.0
    load_delay_s: float = 0.0

    @property
    def compressed(self) -> bool:
        return self.policy != "none"

    def budget_for(self, prefix_tokens: int) -> int:
        """Kept tokens per layer for a prefix of ``prefix_tokens``: floor(fraction * n) (at
        least 1), or the count, never above the prefix."""
        if self.budget_fraction is not None:
            kept = math.floor(self.budget_fraction * prefix_tokens + 1e-9)
        else:
            kept = int(self.budget_tokens or prefix_tokens)
        return max(1, min(prefix_tokens, kept))

    def method(self) -> bytes:
        """What distinguishes one compression of a prefix from another, for its key."""
        budget = (f"{self.budget_fraction!r}" if self.budget_fraction is not None
                  else f"{self.budget_tokens}")
        return f"{self.policy}\0{budget}\0{self.window}".encode()

    def policy_spec(self) -> "common_pb2.PolicySpec":
        from kvsidecar.client import policy

        if self.window:
            return policy(self.policy, window=self.window)
        return policy(self.policy)


def parse(extra: Optional[Mapping[str, Any]]) -> ConnectorConfig:
    """The settings from ``kv_connector_extra_config``; ValueError naming a bad key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown keys {unknown} (known: "
                         f"{', '.join(_KEYS)})")
    cfg = ConnectorConfig()
    cfg.address = str(extra.get("address", cfg.address))
    if extra.get("token_file"):
        with open(str(extra["token_file"]), encoding="utf-8") as f:
            cfg.token = f.readline().strip()
        if not cfg.token:
            raise ValueError(f"kv_connector_extra_config.token_file {extra['token_file']!r} "
                             "has an empty first line")
    cfg.tenant = str(extra.get("tenant", ""))
    cfg.policy = str(extra.get("policy", "none")).lower()
    if cfg.policy not in ("none",) + COMPRESSING_POLICIES + WINDOW_POLICIES:
        raise ValueError(
            f"kv_connector_extra_config.policy {cfg.policy!r}: this connector compresses with "
            f"the query-agnostic policies {', '.join(COMPRESSING_POLICIES)} (a stored prefix "
            "serves any later question), with snapkv over a stated window, or stores whole "
            "('none')")
    if cfg.policy in WINDOW_POLICIES:
        cfg.window = int(extra.get("window", 32))
        if cfg.window < 1:
            raise ValueError("kv_connector_extra_config.window must be >= 1")
    elif "window" in extra:
        raise ValueError(f"kv_connector_extra_config.window applies to "
                         f"{', '.join(WINDOW_POLICIES)} only")
    _parse_budget(cfg, extra.get("budget"))
    cfg.tier = str(extra.get("tier", "")).lower()
    if cfg.tier not in TIERS:
        raise ValueError(f"kv_connector_extra_config.tier {cfg.tier!r} is not one of "
                         f"{sorted(t for t in TIERS if t)} or empty")
    cfg.model_id = str(extra.get("model_id", ""))
    cfg.num_blocks = int(extra.get("num_blocks", 0))
    cfg.timeout = float(extra.get("timeout", cfg.timeout))
    cfg.load_delay_s = float(extra.get("load_delay_s", 0.0))
    return cfg


def _parse_budget(cfg: ConnectorConfig, budget: Any) -> None:
    if not cfg.compressed:
        if budget is not None:
            raise ValueError("kv_connector_extra_config.budget needs a policy")
        return
    if budget is None:
        raise ValueError(f"kv_connector_extra_config.budget is required with policy "
                         f"{cfg.policy!r} (e.g. \"25%\" or 512)")
    text = str(budget).strip()
    if text.endswith("%"):
        fraction = float(text[:-1]) / 100.0
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_connector_extra_config.budget {text!r} must be in (0%, 100%]")
        cfg.budget_fraction = fraction
    else:
        tokens = int(text)
        if tokens < 1:
            raise ValueError(f"kv_connector_extra_config.budget {text!r} must be >= 1")
        cfg.budget_tokens = tokens


def as_dict(cfg: ConnectorConfig) -> Dict[str, Any]:
    """For the start-up log line (the token left out)."""
    return {"address": cfg.address, "tenant": cfg.tenant or None, "token": bool(cfg.token),
            "policy": cfg.policy, "budget": cfg.method().split(b"\0")[1].decode(),
            "window": cfg.window or None,
            "tier": cfg.tier or "default", "model_id": cfg.model_id or None}
