"""Sizes of the end-to-end scenario, and how the benchmark picks a block length that fits memory."""

from __future__ import annotations

from dataclasses import dataclass

# The block length the e2e part picks by default: the largest power of two up to this whose working
# set fits the budget (a real bf16 block of 8 heads x 128 dims x 128 tokens is 256 KiB per region,
# which at 289K tokens x 96 regions would be ~58 GB per prompt).
MAX_AUTO_BLOCK_BYTES = 16 << 10
MIN_AUTO_BLOCK_BYTES = 64
DEFAULT_E2E_BUDGET_BYTES = 3 << 30


class PromptSizes:
    """What a scenario's sizes imply (mixed into the scenarios of the e2e and layouts benchmarks)."""

    __slots__ = ()
    tokens: int
    block_size: int
    regions: int
    chunk_tokens: int
    block_bytes: int

    @property
    def chunks(self) -> int:
        return self.tokens // self.chunk_tokens

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def prompt_blocks(self) -> int:
        return self.chunks * self.blocks_per_chunk

    @property
    def prompt_bytes(self) -> int:
        """Bytes of one prompt's KV (every region of every block)."""
        return self.prompt_blocks * self.regions * self.block_bytes


@dataclass(frozen=True, slots=True)
class Geometry(PromptSizes):
    """Sizes of the end-to-end scenario."""

    tokens: int  # tokens per prompt, whole chunks only
    block_size: int
    regions: int
    chunk_tokens: int
    block_bytes: int
    concurrency: int

    @property
    def num_blocks(self) -> int:
        """The cache: one source set plus one destination set per concurrent load."""
        return (1 + self.concurrency) * self.prompt_blocks

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.regions * self.block_bytes

    @property
    def store_bytes(self) -> int:
        """Peak bytes in the store: one prompt per concurrent request."""
        return self.concurrency * self.prompt_bytes

    @property
    def working_set_bytes(self) -> int:
        return self.cache_bytes + self.store_bytes


def working_set_bytes(
    tokens: int, block_size: int, regions: int, chunk_tokens: int, concurrency: int, block_bytes: int
) -> int:
    whole = tokens // chunk_tokens * chunk_tokens
    return Geometry(whole, block_size, regions, chunk_tokens, block_bytes, concurrency).working_set_bytes


def choose_block_bytes(
    tokens: int,
    block_size: int,
    regions: int,
    chunk_tokens: int,
    concurrency: int,
    budget_bytes: int = DEFAULT_E2E_BUDGET_BYTES,
) -> int:
    """The largest power of two <= 16 KiB whose e2e working set fits ``budget_bytes`` (at least 64)."""
    block_bytes = MAX_AUTO_BLOCK_BYTES
    while block_bytes > MIN_AUTO_BLOCK_BYTES and (
        working_set_bytes(tokens, block_size, regions, chunk_tokens, concurrency, block_bytes) > budget_bytes
    ):
        block_bytes //= 2
    return block_bytes


def store_capacity_bytes(geometry: Geometry) -> int:
    """Store capacity for the run: the peak plus room for allocator overhead (Mooncake's segment
    evicts in the background as it nears full, which would make stored prompts vanish)."""
    return int(geometry.store_bytes * 1.3) + (64 << 20)
