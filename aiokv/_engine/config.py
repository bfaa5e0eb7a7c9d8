"""The engine's frozen configuration: what every step of a batch reads, built once by the worker
(:meth:`EngineConfig.build`, from its checked arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..backends.base import Backend
from ..keys import KeyNamespace, chain_seed
from ..layout import KVLayout


@dataclass(frozen=True, slots=True)
class EngineConfig:
    layouts: tuple[KVLayout, ...]  # one per KV-cache group
    backend: Backend
    chunk_tokens: int
    seed: bytes  # the digest chain's seed (keys.chain_seed(chunk_tokens))
    prefixes: tuple[str, ...]  # per group: the key prefix (namespace, fingerprint, group)
    blocks_per_chunk: tuple[int, ...]  # per group
    chunk_bytes: tuple[int, ...]  # per group: one chunk's value, over all regions
    max_regions_per_call: int  # effective: the worker's argument, else the backend's, else the default
    transfer_threads: int  # the worker's executor_threads: large moves are split across them
    pressure_backoff_s: float  # how long stores pause after the store answered "full"
    exists_in_process: bool  # the backend's trait: lookups are answered on the loop

    @classmethod
    def build(
        cls,
        layouts: Sequence[KVLayout],
        backend: Backend,
        namespace: KeyNamespace,
        chunk_tokens: int,
        *,
        max_regions_per_call: int,
        transfer_threads: int,
        pressure_backoff_s: float,
        exists_in_process: bool,
    ) -> EngineConfig:
        """The figures derived from the worker's checked arguments: the digest chain's seed, each
        group's key prefix, blocks per chunk and bytes per chunk."""
        blocks_per_chunk = tuple(chunk_tokens // layout.block_size for layout in layouts)
        return cls(
            layouts=tuple(layouts),
            backend=backend,
            chunk_tokens=chunk_tokens,
            seed=chain_seed(chunk_tokens),
            prefixes=tuple(namespace.prefix(layout.fingerprint, g) for g, layout in enumerate(layouts)),
            blocks_per_chunk=blocks_per_chunk,
            chunk_bytes=tuple(
                layout.chunk_bytes_per_block * blocks
                for layout, blocks in zip(layouts, blocks_per_chunk, strict=True)
            ),
            max_regions_per_call=max_regions_per_call,
            transfer_threads=transfer_threads,
            pressure_backoff_s=pressure_backoff_s,
            exists_in_process=exists_in_process,
        )

    @property
    def groups(self) -> int:
        return len(self.layouts)
