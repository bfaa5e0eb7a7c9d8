"""The payloads of the connector's KV events (:mod:`.kv_events`): one ``BlockStored`` per chunk, its
blocks' hashes as vLLM's publisher emits them, the block before it as parent, its tokens; a prompt's
last partial block (:mod:`.prompt_tails`) is one block of its own tokens under its own hash.

A chunk is named by its request and index (:class:`ChunkRef`, cheap) when its write is ordered; its
payload (:class:`Chunk`: tokens copied, extra keys derived) is built only once the chunk is admitted
or confirmed, and a chunk never announced costs no more than its reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import vllm.envs as envs
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from .prompt_tails import PromptTails

_INT_HASH_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Tier:
    """How one of the connector's tiers is named in events."""

    medium: str
    locality: str
    ownership: str | None = None


@dataclass(slots=True)
class Chunk:
    """One chunk's BlockStored payload; block hashes as vLLM keeps them (converted as events name
    them when an event is built, so a journal of them outlives ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""

    hashes: list[Any]
    parent: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None
    session_id: str | None

    def fields(self) -> list[Any]:
        """The payload as a list of plain values (the event journal's record)."""
        return [
            self.hashes,
            self.parent,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.lora_name,
            self.extra_keys,
            self.session_id,
        ]

    @classmethod
    def from_fields(cls, fields: list[Any]) -> Chunk:
        hashes, parent, token_ids, block_size, lora_id, lora_name, extra_keys, session_id = fields
        if extra_keys is not None:  # msgpack reads tuples back as lists
            extra_keys = [tuple(keys) if isinstance(keys, list) else keys for keys in extra_keys]
        return cls(
            list(hashes), parent, list(token_ids), block_size, lora_id, lora_name, extra_keys, session_id
        )


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Chunk ``index`` of ``request``; ``end``: where its prompt ends if its tail may be this chunk."""

    request: Any
    index: int
    end: int | None


class Payloads:
    """Builds the payloads of one engine's chunks (``chunk_blocks`` blocks of ``block_size`` tokens)."""

    def __init__(self, block_size: int, chunk_blocks: int, tails: PromptTails) -> None:
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self.tails = tails
        # vLLM's ``maybe_convert_block_hash``, its setting read once (vLLM reads the environment per hash).
        self.int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    def convert(self, block_hash: Any) -> Any:
        """``block_hash`` as events name it."""
        return int.from_bytes(block_hash, byteorder="big") & _INT_HASH_MASK if self.int_hashes else block_hash

    def hashes(self, request: Any, chunk: int, *, end: int) -> list[Any] | None:
        """The vLLM block hashes of ``request``'s chunk ``chunk`` (a tail past its full blocks ending
        at token ``end``), as events carry them; None if unknown."""
        first = chunk * self.chunk_blocks
        raw = request.block_hashes
        if first + self.chunk_blocks <= len(raw):
            return [self.convert(h) for h in raw[first : first + self.chunk_blocks]]
        tail = self.tails.tail_hash(request, end) if first == len(raw) else None
        return [self.convert(tail)] if tail is not None else None

    def chunk(self, ref: ChunkRef) -> Chunk | None:
        """The payload of ``ref``: its full blocks, or, ``ref.end`` given and the chunk not a full
        block below it, the tail of the prompt ending at token ``end``; None if it cannot be named."""
        request, end = ref.request, ref.end
        bs = self.block_size
        first = ref.index * self.chunk_blocks
        raw = request.block_hashes
        tail = False
        if end is not None and (first + self.chunk_blocks > len(raw) or end < (first + 1) * bs):
            tail = True
            tail_hash = self.tails.tail_hash(request, end)
            if tail_hash is None:
                return None
            hashes = [tail_hash]
            start, stop = first * bs, end
            blocks = [(start, stop)]
        elif first + self.chunk_blocks <= len(raw):
            hashes = list(raw[first : first + self.chunk_blocks])
            start, stop = first * bs, (first + self.chunk_blocks) * bs
            blocks = [(b * bs, (b + 1) * bs) for b in range(first, first + self.chunk_blocks)]
        else:
            return None
        lora = request.lora_request
        return Chunk(
            hashes=hashes,
            parent=raw[first - 1] if first else None,
            token_ids=list(request.all_token_ids[start:stop]),
            block_size=stop - start if tail else bs,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=_extra_keys(request, blocks),
            session_id=getattr(request, "session_id", None),
        )

    def stored(self, chunk: Chunk, tier: Tier) -> BlockStored:
        return BlockStored(
            block_hashes=[self.convert(h) for h in chunk.hashes],
            parent_block_hash=self.convert(chunk.parent) if chunk.parent is not None else None,
            token_ids=chunk.token_ids,
            block_size=chunk.block_size,
            lora_id=chunk.lora_id,
            medium=tier.medium,
            lora_name=chunk.lora_name,
            extra_keys=chunk.extra_keys,
            group_idx=0,
            locality=tier.locality,
            ownership=tier.ownership,
            session_id=chunk.session_id,
        )


def _extra_keys(request: Any, blocks: list[tuple[int, int]]) -> list[Any] | None:
    """The event's extra keys of ``request``'s ``blocks`` (token ranges), as vLLM's own events: a text
    request without LoRA, cache salt or prompt embeddings has none in any block, derived without
    asking vLLM block by block."""
    if (
        not getattr(request, "mm_features", None)
        and not request.lora_request
        and getattr(request, "prompt_embeds", None) is None
        and not (blocks[0][0] == 0 and getattr(request, "cache_salt", None))
    ):
        return [None] * len(blocks)
    return to_event_extra_keys([generate_block_hash_extra_keys(request, a, b, 0)[0] for a, b in blocks])


def removed(hashes: list[Any], tier: Tier) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=hashes, medium=tier.medium, group_idx=0, locality=tier.locality, ownership=tier.ownership
    )


def parents_first(chunks: Mapping[str, Chunk]) -> list[str]:
    """The digests of ``chunks``, each after the chunk its parent block ends (if among them), as vLLM
    announces a prompt's blocks: a subscriber linking a block to its parent has it already."""
    by_last = {chunk.hashes[-1]: digest for digest, chunk in chunks.items()}
    order: list[str] = []
    seen: set[str] = set()
    for digest in chunks:
        path = []
        current: str | None = digest
        while current is not None and current not in seen:
            seen.add(current)
            path.append(current)
            parent = chunks[current].parent
            current = by_last.get(parent) if parent is not None else None
        order.extend(reversed(path))
    return order
