"""The connector's ``kv_connector_extra_config`` keys, and the Mooncake JSON vLLM users already have.

Every key is checked when the engine starts; a wrong one raises ``ValueError`` naming it. docs/vllm.md
describes each key.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....backends.mooncake import CONFIG_ENV_VAR, parse_size

logger = logging.getLogger("aiokv.vllm")

KEY_FORMATS = ("aiokv", "vllm")
BACKENDS = ("mooncake", "memory", "tiered", "disk", "disk-tiered")
DISK_BACKENDS = ("disk", "disk-tiered")

# Keys vLLM's MooncakeStoreConnector reads that mean nothing here; accepted so a config can be reused.
IGNORED_VLLM_KEYS = frozenset(
    {
        "lookup_async",
        "store_tp_size",
        "enable_store_tp_lcm",
        "prefill_tp_sizes",
        "enable_group_semantics",
        "custom_mem_pool",
        "enable_cross_layers_blocks",
    }
)

# Keys of Mooncake's own client JSON (mooncake.mooncake_config, vLLM's MooncakeStoreConfig) that a
# pure store client has no use for: accepted and ignored.
_IGNORED_MOONCAKE_KEYS = frozenset(
    {"enable_ssd_offload", "ssd_offload_path", "enable_client_http_server", "client_http_port"}
)
_MOONCAKE_MODES = ("embedded", "standalone-store")
_DEFAULT_TENANT = "default"


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def _positive(extra: Mapping[str, Any], key: str, default: float, *, integer: bool = False) -> Any:
    value = extra.get(key, default)
    wrong_type = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if wrong_type or not 0 < value < float("inf"):
        kind = "a positive int" if integer else "a positive number"
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {kind}, got {value!r}")
    return value


def _non_negative(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ConnectorConfig:
    """The parsed ``kv_connector_extra_config``."""

    backend: str = "mooncake"
    mooncake_config: Mapping[str, Any] | str | None = None
    key_format: str = "aiokv"
    chunk_blocks: int = 1
    load_async: bool = True
    enable_lookup: bool = True
    save_decode_cache: bool = False
    store_prompt_tails: bool = True
    model_name: str | None = None
    cache_prefix: str = ""
    memory_capacity: int = 1 << 30
    disk_path: str | None = None
    disk_capacity: int = 64 << 30
    memory_cache_capacity: int = 0  # host memory caching the disk tier; 0: none
    lookup_timeout_s: float = 5.0
    lookup_wait_s: float = 0.02
    idle_wait_s: float = 0.002
    load_timeout_s: float = 30.0
    store_timeout_s: float = 60.0
    setup_retries: int = 2
    executor_threads: int = 1
    max_batch_chunks: int | None = None
    # Keys per chunk, one per run of consecutive layers: > 1 moves a chunk layer group by layer group
    # (synchronous loads overlap the forward, stores leave during it).
    layer_groups: int = 1
    verify_values: bool = True
    decline_slow_loads: bool = False

    @property
    def host_tier(self) -> bool:
        """Whether the engine's workers keep a tier of their own (``"memory"``, ``"disk"``: alone;
        ``"tiered"``, ``"disk-tiered"``: in front of Mooncake), indexed by the scheduler."""
        return self.backend in ("memory", "tiered", *DISK_BACKENDS)

    @property
    def disk_tier(self) -> bool:
        """Whether that tier's store is a :class:`~aiokv.backends.disk.DiskBackend` per rank."""
        return self.backend in DISK_BACKENDS

    @property
    def remote(self) -> bool:
        """Whether there is a store outside the engine (Mooncake, or a backend of the user's own)."""
        return self.backend not in ("memory", "disk")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__) | IGNORED_VLLM_KEYS | {"preferred_segment"}
        unknown = sorted(key for key in extra if key not in known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) for AiokvConnector: {', '.join(unknown)}; "
                f"known keys: {', '.join(sorted(cls.__dataclass_fields__))} (see docs/vllm.md)"
            )
        ignored = sorted(key for key in extra if key in IGNORED_VLLM_KEYS)
        if ignored:
            logger.warning("aiokv: ignoring vLLM MooncakeStoreConnector key(s) %s", ", ".join(ignored))
        backend = extra.get("backend", "mooncake")
        if backend not in BACKENDS and not (isinstance(backend, str) and ":" in backend):
            raise ValueError(
                f"kv_connector_extra_config['backend'] must be one of {BACKENDS} or 'module:factory', "
                f"got {backend!r}"
            )
        key_format = extra.get("key_format", "aiokv")
        if key_format not in KEY_FORMATS:
            raise ValueError(
                f"kv_connector_extra_config['key_format'] must be one of {KEY_FORMATS}, got {key_format!r}"
            )
        chunk_blocks = _positive(extra, "chunk_blocks", 1, integer=True)
        if key_format == "vllm" and chunk_blocks != 1:
            raise ValueError(
                "key_format 'vllm' stores one key per block (as vLLM's MooncakeStoreConnector does): "
                f"chunk_blocks must be 1, got {chunk_blocks}"
            )
        if key_format == "vllm" and _bool(extra, "verify_values", False):
            raise ValueError(
                "key_format 'vllm' stores values byte-identical to vLLM's MooncakeStoreConnector, which "
                "carry no checksum: verify_values must be false (or unset) with it"
            )
        mooncake = extra.get("mooncake_config")
        if mooncake is not None and not isinstance(mooncake, (str, Mapping)):
            raise ValueError(
                "kv_connector_extra_config['mooncake_config'] must be a JSON file path or a dict, "
                f"got {type(mooncake).__name__}"
            )
        if "preferred_segment" in extra:
            mooncake = {**load_mooncake_source(mooncake), "preferred_segment": extra["preferred_segment"]}
        for key in ("model_name", "cache_prefix"):
            value = extra.get(key)
            if value is not None and (not isinstance(value, str) or any(c.isspace() for c in value)):
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}] must be a str without spaces, got {value!r}"
                )
        memory_capacity = parse_size(extra.get("memory_capacity", 1 << 30), "memory_capacity")
        if memory_capacity <= 0:
            raise ValueError(
                f"kv_connector_extra_config['memory_capacity'] must be positive, got {memory_capacity}"
            )
        disk_capacity = parse_size(extra.get("disk_capacity", 64 << 30), "disk_capacity")
        if disk_capacity <= 0:
            raise ValueError(
                f"kv_connector_extra_config['disk_capacity'] must be positive, got {disk_capacity}"
            )
        disk_path = checked_disk_path(extra.get("disk_path"), backend) if backend in DISK_BACKENDS else None
        memory_cache = parse_size(extra.get("memory_cache_capacity", 0), "memory_cache_capacity")
        if memory_cache < 0 or (memory_cache and backend not in DISK_BACKENDS):
            raise ValueError(
                "kv_connector_extra_config['memory_cache_capacity'] must be >= 0 and applies to the "
                f"backends {DISK_BACKENDS} only, got {memory_cache} with backend {backend!r}"
            )
        layer_groups = _positive(extra, "layer_groups", 1, integer=True)
        if layer_groups > 1 and (key_format == "vllm" or (backend != "mooncake" and ":" not in backend)):
            raise ValueError(
                f"kv_connector_extra_config['layer_groups'] {layer_groups} needs key_format 'aiokv' and "
                f"a store without a host tier (backend 'mooncake' or 'module:factory'), got key_format "
                f"{key_format!r}, backend {backend!r}"
            )
        return cls(
            backend=backend,
            mooncake_config=mooncake,
            key_format=key_format,
            chunk_blocks=chunk_blocks,
            load_async=_bool(extra, "load_async", True),
            enable_lookup=_bool(extra, "enable_lookup", True),
            save_decode_cache=_bool(extra, "save_decode_cache", False),
            store_prompt_tails=_bool(extra, "store_prompt_tails", True),
            model_name=extra.get("model_name"),
            cache_prefix=extra.get("cache_prefix") or "",
            memory_capacity=memory_capacity,
            disk_path=disk_path,
            disk_capacity=disk_capacity,
            memory_cache_capacity=memory_cache,
            lookup_timeout_s=float(_positive(extra, "lookup_timeout_s", 5.0)),
            lookup_wait_s=float(_positive(extra, "lookup_wait_s", 0.02)),
            idle_wait_s=float(_non_negative(extra, "idle_wait_s", 0.002)),
            load_timeout_s=float(_positive(extra, "load_timeout_s", 30.0)),
            store_timeout_s=float(_positive(extra, "store_timeout_s", 60.0)),
            setup_retries=_positive(extra, "setup_retries", 2, integer=True),
            executor_threads=_positive(extra, "executor_threads", 1, integer=True),
            max_batch_chunks=(
                None
                if extra.get("max_batch_chunks") is None
                else _positive(extra, "max_batch_chunks", 1, integer=True)
            ),
            layer_groups=layer_groups,
            verify_values=key_format == "aiokv" and _bool(extra, "verify_values", True),
            decline_slow_loads=_bool(extra, "decline_slow_loads", False),
        )


def checked_disk_path(path: Any, backend: str) -> str:
    """``disk_path`` as an absolute path: an existing directory this process can write (each rank
    makes its own ``rank-<n>`` in it); ``ValueError`` naming the key and the path otherwise."""
    key = "kv_connector_extra_config['disk_path']"
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"backend {backend!r} needs {key}: a directory for the disk tier, got {path!r}")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ValueError(f"{key} {path} does not exist: create the directory first")
    if not os.path.isdir(path):
        raise ValueError(f"{key} {path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{key} {path} is not writable by this process (read-only, or its permissions)")
    return path


def load_mooncake_source(source: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The Mooncake JSON as a dict: from a dict, a JSON file path, or ``MOONCAKE_CONFIG_PATH``."""
    if isinstance(source, Mapping):
        return dict(source)
    path = source or os.environ.get(CONFIG_ENV_VAR)
    if not path:
        raise ValueError(
            "AiokvConnector with backend 'mooncake' needs a Mooncake config: set "
            f"kv_connector_extra_config['mooncake_config'] (a dict or JSON path) or {CONFIG_ENV_VAR}"
        )
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the Mooncake config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"the Mooncake config {path} must hold a JSON object")
    return config


def default_local_hostname() -> str:
    """What vLLM's connector would use: its env overrides, else the host's IP as vLLM finds it."""
    for name in ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "VLLM_HOST_IP"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


def mooncake_client_config(source: Mapping[str, Any] | str | None, *, pure_client: bool) -> dict[str, Any]:
    """Translate vLLM's/Mooncake's JSON into :class:`aiokv.backends.mooncake.MooncakeConfig` keys.

    ``mode``: "embedded" (this engine mounts ``global_segment_size``) or "standalone-store" (the
    engine is a pure client, ``global_segment_size`` 0, another process holds the memory).
    ``pure_client``: the scheduler's lookup client, which never holds KV.
    """
    config = load_mooncake_source(source)
    mode = config.pop("mode", "embedded")
    if mode not in _MOONCAKE_MODES:
        raise ValueError(f"Mooncake config 'mode' must be one of {_MOONCAKE_MODES}, got {mode!r}")
    tenant = config.pop("tenant_id", None)
    if tenant not in (None, "", _DEFAULT_TENANT):
        # Mooncake keeps tenants apart; serving another tenant's namespace silently would be wrong.
        raise ValueError(
            f"Mooncake config 'tenant_id' {tenant!r} is not supported by aiokv's Mooncake backend yet; "
            "remove it (the default tenant) or use 'cache_prefix' to separate deployments"
        )
    offload = config.pop("enable_offload", False)
    if not isinstance(offload, bool):
        raise ValueError(f"Mooncake config 'enable_offload' must be true or false, got {offload!r}")
    for key in _IGNORED_MOONCAKE_KEYS & set(config):
        config.pop(key)
        logger.info("aiokv: Mooncake config key %r has no effect on a store client; ignored", key)
    if mode == "standalone-store":
        if parse_size(config.get("global_segment_size", 0), "global_segment_size") != 0:
            raise ValueError("Mooncake config 'mode' standalone-store requires 'global_segment_size' 0")
        config["global_segment_size"] = 0
    if "local_hostname" not in config:
        config["local_hostname"] = default_local_hostname()
    config.setdefault("protocol", "tcp")
    config.setdefault("device_name", "")
    if pure_client:
        config["global_segment_size"] = 0
        config["local_buffer_size"] = 16 << 20
    return config


def tier_capacity_per_rank(config: ConnectorConfig, world_size: int) -> int:
    """Each worker's share of ``memory_capacity`` (the engine's whole host tier, as vLLM's
    ``--kv-offloading-size`` counts it), or of ``disk_capacity`` for a disk tier: every rank holds its
    shard of the same chunks."""
    capacity = config.disk_capacity if config.disk_tier else config.memory_capacity
    return int(capacity) // max(1, world_size)
