"""The engine's frozen configuration: what every step of a batch reads, built once by the worker."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Backend
from ..layout import KVLayout


@dataclass(frozen=True, slots=True)
class EngineConfig:
    layouts: tuple[KVLayout, ...]  # one per KV-cache group
    backend: Backend
    chunk_tokens: int
    seed: bytes  # the digest chain's seed (keys.chain_seed(chunk_tokens))
    prefixes: tuple[str, ...]  # per group: the key prefix (namespace, fingerprint, group)
    blocks_per_chunk: tuple[int, ...]  # per group
    max_regions_per_call: int  # effective: the worker's argument, else the backend's, else the default
    transfer_threads: int  # the worker's executor_threads: large moves are split across them
    pressure_backoff_s: float  # how long stores pause after the store answered "full"
    exists_in_process: bool  # the backend's trait: lookups are answered on the loop

    @property
    def groups(self) -> int:
        return len(self.layouts)
