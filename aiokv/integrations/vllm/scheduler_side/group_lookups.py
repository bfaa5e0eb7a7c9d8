"""One lookup in flight over every KV cache group of an engine: what the scheduler asks the store
before it answers vLLM how many tokens a request can load.

Each attention group is asked for its leading run of the prompt's chunks; a sliding-window group whose
run is shorter than the others' is asked a second round, for the window before their end (vLLM's own
connector stores only such windows); each state group (:mod:`.state_groups`) is asked for its state at
every chunk end. The hit is as long as every group can serve.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ....keys import HashedPrompt
from ..common.geometry import KVGeometry
from .state_groups import StateGroups


@dataclass
class GroupLookup:
    futures: list[concurrent.futures.Future[int]]  # one per attention group
    prompt: HashedPrompt
    deadline: float
    # State groups: per group, whether it holds the state at each chunk end.
    states: dict[int, list[concurrent.futures.Future[int]]] = field(default_factory=dict)
    # Second round, per sliding-window group (its index among the attention groups): its first chunk
    # and its chunks found from there.
    window: dict[int, tuple[int, concurrent.futures.Future[int]]] | None = None
    end: int = 0  # the hit (in chunks) the second round checks
    tail: bool = False  # the prompt's last chunk is its partial last block (:mod:`.prompt_tails`)

    def pending(self) -> list[concurrent.futures.Future[int]]:
        """Every future asked so far."""
        window = [future for _, future in (self.window or {}).values()]
        return [*self.futures, *window, *(future for futures in self.states.values() for future in futures)]

    def ask_windows(
        self, groups: Sequence[KVGeometry], clients: Sequence[Any], chunk_tokens: int, wait_s: float
    ) -> bool:
        """After the first round: ask the sliding-window groups (``groups``: the attention groups, and
        their ``clients``) whose leading run ends before the other groups' for the window before that
        end. True if a second round was asked."""
        found = [int(future.result()) // chunk_tokens for future in self.futures]
        others = [n for n, group in zip(found, groups, strict=True) if group.sliding_window is None]
        self.end = end = min(others, default=len(self.prompt.hashes))
        short = [g for g, group in enumerate(groups) if group.sliding_window is not None and found[g] < end]
        if not short or not end:
            return False
        self.window = {}
        # A hit ending with the prompt's partial tail ends inside its last chunk: the window reaches
        # back from there, so it is taken from the chunk before (one chunk more, never one too few).
        window_end = end - 1 if self.tail and end == len(self.prompt.hashes) else end
        for g in short:
            first = groups[g].window_first_chunk(window_end, chunk_tokens)
            window = HashedPrompt(self.prompt.hashes[first:end], chunk_tokens)
            self.window[g] = (first, clients[g].lookup_many([window])[0])
        concurrent.futures.wait([future for _, future in self.window.values()], timeout=wait_s)
        return True

    def found_chunks(self, chunk_tokens: int, states: StateGroups) -> int:
        """The leading chunks every group can serve: the other groups' run if each sliding-window group
        holds its window before the run's end, else the shortest leading run of any group; then, with
        state groups, the longest end within it where every state group holds its state."""
        chunks = min(int(future.result()) for future in self.futures) // chunk_tokens
        if self.window is not None and all(
            int(future.result()) // chunk_tokens >= self.end - first for first, future in self.window.values()
        ):
            chunks = self.end
        return states.hit(chunks, self.states) if states else chunks
