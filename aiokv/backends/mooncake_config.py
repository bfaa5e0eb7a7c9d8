"""Mooncake store configuration, written the way vLLM/LMCache users already write it.

:class:`MooncakeConfig` validates it; :func:`parse_size` reads sizes such as ``"512MB"``. Nothing here
imports ``mooncake``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Any

# What to install for Mooncake; shared by the backend and the master launcher.
INSTALL_HINT = "pip install 'aiokv[mooncake-cpu]' (or 'aiokv[mooncake-gpu]' on GPU hosts)"

CONFIG_ENV_VAR = "MOONCAKE_CONFIG_PATH"

# Mooncake's own defaults (mooncake.mooncake_config), so an omitted key means what it means there.
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30
# Setup refuses a smaller (nonzero) segment with -600 (measured on 0.3.13).
MIN_GLOBAL_SEGMENT_SIZE = 16 << 20
# A client service's staging buffer holds at least a few chunks' values per transfer lane.
MIN_STAGING_SIZE = 16 << 20

_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?)b?|b)?\s*$", re.IGNORECASE)
# Binary multiples for "MB" as well as "MiB": Mooncake's own parser reads "512MB" as 512 MiB.
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}

_REQUIRED_KEYS = ("local_hostname", "metadata_server", "master_server_address")


def parse_size(value: object, key: str) -> int:
    """Bytes from an int or a string such as ``"512MB"``, ``"4GiB"``, ``"1.5 GB"`` (binary units)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{key} must be an int number of bytes or a string such as '512MB', not {type(value).__name__}"
        )
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_PATTERN.match(value)
        if match is None:
            raise ValueError(f"{key}: cannot read {value!r} as a size (examples: 1048576, '512MB', '4GiB')")
        number, unit, _ = match.groups()
        exact = Fraction(number) * _SIZE_UNITS[(unit or "").lower()]
        if exact.denominator != 1:
            raise ValueError(f"{key}: {value!r} is not a whole number of bytes")
        size = int(exact)
    if size < 0:
        raise ValueError(f"{key} must not be negative, got {size}")
    return size


@dataclass(frozen=True)
class MooncakeConfig:
    """A validated Mooncake store configuration.

    The keys are those of Mooncake's own JSON config (as vLLM and LMCache users write it) plus the
    replica options of ``ReplicateConfig``. Sizes may be given as strings (see :func:`parse_size`);
    ``global_segment_size=0`` makes a pure client that stores nothing itself.

    ``client_service`` (``"host:port"``) attaches this client to a Mooncake client service running on
    this host (``mooncake_client``, which holds the segment and runs the transfer engine) through
    shared memory, instead of running a transfer engine here: the service moves the bytes into a
    shared staging buffer of ``local_buffer_size`` and this process copies them to and from its
    registered memory, two memory copies where TCP between processes costs ~10x the CPU. Such a
    client mounts nothing (``global_segment_size`` 0, the default when ``client_service`` is given).
    """

    local_hostname: str
    metadata_server: str
    master_server_address: str
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    # Replica options (mooncake.store.ReplicateConfig), applied to every put.
    replica_num: int = 1
    preferred_segment: str = ""
    preferred_segments: tuple[str, ...] = ()
    prefer_alloc_in_same_node: bool = False
    with_hard_pin: bool = False
    # The master's --default_kv_lease_ttl (ms): how long a key an existence check found stays leased.
    # The client cannot ask the master; the worker counts its lookups' hits this long (aiokv.leases).
    default_kv_lease_ttl: int = 10_000
    # "host:port" of a Mooncake client service on this host to attach to (see the class docstring).
    client_service: str = ""

    def __post_init__(self) -> None:
        for key in _REQUIRED_KEYS:
            value = getattr(self, key)
            if not isinstance(value, str):
                raise TypeError(f"{key} must be a str, not {type(value).__name__}")
            if not value.strip():
                raise ValueError(f"{key} must not be empty")
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(
                f"protocol must be a non-empty str such as 'tcp' or 'rdma', got {self.protocol!r}"
            )
        # The C++ side matches protocol names case-sensitively, in lower case.
        object.__setattr__(self, "protocol", self.protocol.strip().lower())
        device = "" if self.device_name is None else self.device_name
        if not isinstance(device, str):
            raise TypeError(f"device_name must be a str, not {type(device).__name__}")
        object.__setattr__(self, "device_name", device)
        for key in ("global_segment_size", "local_buffer_size"):
            object.__setattr__(self, key, parse_size(getattr(self, key), key))
        if 0 < self.global_segment_size < MIN_GLOBAL_SEGMENT_SIZE:
            raise ValueError(
                f"global_segment_size must be 0 (a pure client) or at least {MIN_GLOBAL_SEGMENT_SIZE} "
                f"bytes (16 MiB, Mooncake's minimum), got {self.global_segment_size}"
            )
        if isinstance(self.replica_num, bool) or not isinstance(self.replica_num, int):
            raise TypeError(f"replica_num must be an int, not {type(self.replica_num).__name__}")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be at least 1, got {self.replica_num}")
        if not isinstance(self.preferred_segment, str):
            raise TypeError(f"preferred_segment must be a str, not {type(self.preferred_segment).__name__}")
        segments = self.preferred_segments
        if isinstance(segments, str) or not isinstance(segments, (list, tuple)):
            raise TypeError(f"preferred_segments must be a list of str, not {type(segments).__name__}")
        if not all(isinstance(segment, str) and segment for segment in segments):
            raise ValueError(f"preferred_segments must hold non-empty strings, got {segments!r}")
        object.__setattr__(self, "preferred_segments", tuple(segments))
        ttl = self.default_kv_lease_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
            raise ValueError(f"default_kv_lease_ttl must be milliseconds >= 0 (an int), got {ttl!r}")
        for key in ("prefer_alloc_in_same_node", "with_hard_pin"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{key} must be true or false, not {getattr(self, key)!r}")
        self._check_client_service()

    def _check_client_service(self) -> None:
        service = self.client_service
        if not isinstance(service, str):
            raise TypeError(f"client_service must be a 'host:port' str, not {type(service).__name__}")
        if not service:
            return
        host, _, port = service.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"client_service must be 'host:port', got {service!r}")
        if self.global_segment_size:
            raise ValueError(
                "a client of a Mooncake client service mounts no memory (the service holds the segment): "
                f"set global_segment_size 0 or leave it out, got {self.global_segment_size}"
            )
        if self.local_buffer_size < MIN_STAGING_SIZE:
            raise ValueError(
                f"local_buffer_size is the staging buffer shared with the client service: at least "
                f"{MIN_STAGING_SIZE} bytes, got {self.local_buffer_size}"
            )

    # -- sources --------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> MooncakeConfig:
        """From a mapping of config keys; unknown keys and missing required ones are refused."""
        if not isinstance(config, Mapping):
            raise TypeError(f"a Mooncake config must be a mapping, not {type(config).__name__}")
        known = [field.name for field in fields(cls)]
        unknown = sorted(str(key) for key in config if key not in known)
        if unknown:
            raise ValueError(
                f"unknown Mooncake config key(s) {', '.join(unknown)}; known keys: {', '.join(known)}"
            )
        missing = [key for key in _REQUIRED_KEYS if key not in config]
        if missing:
            raise ValueError(f"Mooncake config is missing required key(s): {', '.join(missing)}")
        if config.get("client_service") and "global_segment_size" not in config:
            config = {**config, "global_segment_size": 0}  # the service holds the segment
        return cls(**config)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeConfig:
        """From a JSON file holding one object."""
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"Mooncake config file {path} is not valid JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise TypeError(
                f"Mooncake config file {path} must hold a JSON object, not {type(config).__name__}"
            )
        try:
            return cls.from_dict(config)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: {exc}") from exc

    @classmethod
    def from_env(cls) -> MooncakeConfig:
        """From the JSON file named by ``MOONCAKE_CONFIG_PATH``."""
        path = os.environ.get(CONFIG_ENV_VAR)
        if not path:
            raise ValueError(
                f"no Mooncake config: pass a dict or a JSON file path, or set {CONFIG_ENV_VAR} to a JSON file"
            )
        return cls.from_file(path)

    @classmethod
    def load(
        cls, source: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str] | None
    ) -> MooncakeConfig:
        """Whichever the caller has: a config, a dict, a JSON file path, or ``None`` for the env var."""
        if isinstance(source, MooncakeConfig):
            return source
        if source is None:
            return cls.from_env()
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, (str, os.PathLike)):
            return cls.from_file(source)
        raise TypeError(
            f"Mooncake config must be a dict, a JSON file path or None, not {type(source).__name__}"
        )
