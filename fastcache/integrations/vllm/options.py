"""fastcache's settings in vLLM's `kv_connector_extra_config`, checked once at engine start (no vLLM import).

An unknown key, a CPU tier of 0 bytes or larger than the machine, a bad store URL or an unknown eviction
policy is refused with one error that names the key, before any memory is taken.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

from ...config import check_namespace
from ...eviction import DEFAULT_POLICY, POLICIES
from ...store.remote import QUERY_TIMEOUT
from ...store.url import parse_store_url

# Keys vLLM's OffloadingConnector itself reads from the same dict (vllm 0.32): accepted, left to vLLM.
VLLM_KEYS = frozenset({"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
                       "offload_prompt_only", "self_describing_kv_events"})
FASTCACHE_KEYS = frozenset({"cpu_bytes_to_use", "store", "namespace", "transfer_timeout", "policy",
                            "store_timeout"})


class ConfigError(ValueError):
    """A bad kv_connector_extra_config value; the message names the key."""


@dataclass(frozen=True)
class VllmOptions:
    cpu_bytes_to_use: int            # the CPU tier, every worker's share together (as vLLM's CPU spec counts it)
    store: str | None = None         # L3: mooncake://HOST:PORT or file:///DIR
    namespace: str | None = None     # model and weight version in L3 keys; default: the model's name
    transfer_timeout: float = 30.0   # seconds before vLLM is told a transfer failed (a swap-in: once it ended)
    policy: str = DEFAULT_POLICY     # the CPU tier's eviction policy (fastcache/eviction.py's POLICIES)
    store_timeout: float = QUERY_TIMEOUT    # seconds a scheduler lookup waits for the store (then a miss)

    @classmethod
    def from_extra_config(cls, extra: dict) -> "VllmOptions":
        unknown = sorted(set(extra) - VLLM_KEYS - FASTCACHE_KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: {unknown[0]!r} is an unknown key (fastcache's: "
                              f"{sorted(FASTCACHE_KEYS)}; vLLM's: {sorted(VLLM_KEYS)})")
        if "cpu_bytes_to_use" not in extra:
            raise ConfigError("kv_connector_extra_config: 'cpu_bytes_to_use' is required (bytes of CPU tier)")
        size = extra["cpu_bytes_to_use"]
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size != int(size) or size < 1:
            raise ConfigError(f"kv_connector_extra_config: 'cpu_bytes_to_use' must be a positive number of "
                              f"bytes, got {size!r}")
        total = psutil.virtual_memory().total
        if size > total:
            raise ConfigError(f"kv_connector_extra_config: 'cpu_bytes_to_use' is {int(size)} bytes, more than "
                              f"this machine's memory ({total} bytes)")
        for key, check in (("store", parse_store_url), ("namespace", check_namespace)):
            if extra.get(key) is not None:
                try:
                    check(extra[key])
                except ValueError as exc:
                    raise ConfigError(f"kv_connector_extra_config: {key!r}: {exc}") from None
        store, namespace = extra.get("store"), extra.get("namespace")
        timeout = extra.get("transfer_timeout", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ConfigError(f"kv_connector_extra_config: 'transfer_timeout' must be seconds in (0, 3600], "
                              f"got {timeout!r}")
        store_timeout = extra.get("store_timeout", QUERY_TIMEOUT)
        if isinstance(store_timeout, bool) or not isinstance(store_timeout, (int, float)) \
                or not 0 < store_timeout <= 60:
            raise ConfigError(f"kv_connector_extra_config: 'store_timeout' must be seconds in (0, 60] (how long a "
                              f"lookup waits for the store before it is a miss), got {store_timeout!r}")
        policy = extra.get("policy")
        if policy is None:
            policy = DEFAULT_POLICY
        elif not isinstance(policy, str) or policy not in POLICIES:
            raise ConfigError(f"kv_connector_extra_config: 'policy' must be one of {sorted(POLICIES)} (the CPU "
                              f"tier's eviction policy; default {DEFAULT_POLICY!r}), got {policy!r}")
        return cls(int(size), store, namespace, float(timeout), policy, float(store_timeout))
