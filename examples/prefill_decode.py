"""Prefill -> decode across processes through one Mooncake store, every loaded byte verified.

Run it (inside a private network namespace where nothing may leave the machine, see the README)::

    python examples/prefill_decode.py                       # starts its own mooncake_master
    python examples/prefill_decode.py --master 127.0.0.1:50051

Three processes, as in a disaggregated deployment:

- **this process** is the router and the store's memory: it starts a ``mooncake_master`` unless
  ``--master`` names one, and runs a Mooncake client that mounts a global segment (``--segment``).
  In Mooncake an object lives in the segment of the client that provides it, not in the master; so
  the memory must belong to a process that outlives the engines, as a storage node's does. If the
  prefill engine provided the segment itself, its KV would vanish when it exits.
- **prefill** (a child, ``KVWorker`` on asyncio) computes the prompt's KV into its own paged cache
  (here: random bytes from a seed), stores the prompt's whole chunks from scattered block ids, writes
  a checksum of every (group, chunk) value to a manifest, closes its client and exits.
- **decode** (a child, ``ThreadedKVWorker`` as an engine's synchronous thread would use) has its own
  cache, of another size, and other block ids. It looks the prompt up, loads it, recomputes the
  checksums from its own blocks and compares them with the manifest.

Both engines are pure Mooncake clients (``global_segment_size=0``): their puts and gets cross over
TCP to the store's segments (here the router's). The children are started with ``subprocess`` and
``sys.executable``: a process with Mooncake's threads must not be forked. The cache has two KV-cache
groups (full attention with 16-token blocks, sliding window with 32-token blocks), as hybrid models
have.

The exit status is 0 only if decode loaded every stored chunk and every checksum matched; 3 when a
chunk was missing or its bytes differ; another non-zero status on any other failure (the failing
engine's log is shown). ``--simulate-corruption CHUNK`` flips a bit of one loaded chunk on the
decode side before the check, to show that a wrong byte is caught.

The clients here are loopback clients (``MooncakeBackend.from_master``); across machines, build the
backends from a Mooncake config (``MooncakeBackend({...})``) with real host names.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiokv import (
    BackendUnavailableError,
    HashedPrompt,
    KVLayout,
    KVWorker,
    MooncakeBackend,
    MooncakeMaster,
    StoreResult,
    ThreadedKVWorker,
    run,
)
from aiokv.testing import PagedCache, chunk_block_ids, chunk_value

CHUNK_TOKENS = 64
HEADS, HEAD_DIM = 4, 64  # per layer, K and V each: block bytes = block_size * HEADS * HEAD_DIM * 2


@dataclass(frozen=True)
class GroupSpec:
    name: str
    layers: int
    block_size: int


# The model's KV-cache groups; prefill and decode must agree on them (they enter every key).
GROUPS = (
    GroupSpec("full_attention", layers=8, block_size=16),
    GroupSpec("sliding_window", layers=2, block_size=32),
)
PREFILL_BLOCKS, DECODE_BLOCKS = 512, 384  # blocks per region: the two engines' caches differ in size


ROLES = ("router", "prefill", "decode")
MISMATCH = 3  # exit status of a decode whose bytes differ (reported on stdout, so no log is shown)


def say(text: str) -> None:
    """One line of the example's report; flushed, since the three processes share stdout."""
    print(text, flush=True)


# -- the engines' paged KV cache -------------------------------------------------------------------


class PagedKVCache:
    """The engine's KV cache: aiokv.testing's toy paged cache, one group per ``GROUPS`` entry, one region
    per (layer, K/V), a block holding ``block_size x HEADS x HEAD_DIM`` float16 values."""

    def __init__(self, num_blocks: int, seed: int | None) -> None:
        specs = [
            {
                "num_regions": 2 * spec.layers,
                "num_blocks": num_blocks,
                "block_size": spec.block_size,
                "block_lens": spec.block_size * HEADS * HEAD_DIM * 2,
                "dtype": "float16",
            }
            for spec in GROUPS
        ]
        # "Computed" KV: random bit patterns from the seed; a decode cache (no seed) starts zeroed.
        self.cache = PagedCache.allocate(specs, fill=0 if seed is None else "random", seed=seed or 0)
        self.layouts: list[KVLayout] = self.cache.layouts

    def block_table(self, rng: np.random.Generator, num_tokens: int) -> list[np.ndarray]:
        """Per group, the scattered blocks an engine's allocator might hand out for ``num_tokens``."""
        tables = []
        for spec, layout in zip(GROUPS, self.layouts, strict=True):
            needed = -(-num_tokens // spec.block_size)
            tables.append(rng.permutation(layout.num_blocks)[:needed].astype(np.int64))
        return tables

    def checksums(self, block_table: list[np.ndarray], chunks: int) -> list[list[str]]:
        """Per group and chunk, a digest of the chunk's value: region by region, its blocks in order."""
        digests = []
        for spec, group, ids in zip(GROUPS, self.cache.groups, block_table, strict=True):
            per = CHUNK_TOKENS // spec.block_size
            values = (chunk_value(group, chunk_block_ids(ids, chunk, per)) for chunk in range(chunks))
            digests.append([hashlib.blake2b(value, digest_size=16).hexdigest() for value in values])
        return digests

    @property
    def nbytes_per_chunk(self) -> int:
        return sum(g.chunk_bytes_per_block * CHUNK_TOKENS // g.block_size for g in self.layouts)


# -- prefill ---------------------------------------------------------------------------------------


async def store_prompt(
    cache: PagedKVCache, backend: MooncakeBackend, model: str, tokens: list[int], table: list[np.ndarray]
) -> StoreResult:
    async with KVWorker(cache.layouts, backend, namespace=model, chunk_tokens=CHUNK_TOKENS) as worker:
        return await worker.store(tokens, table)


def prefill(args: argparse.Namespace) -> int:
    request = json.loads((args.workdir / "request.json").read_text())
    tokens: list[int] = request["tokens"]
    cache = PagedKVCache(PREFILL_BLOCKS, seed=args.seed)
    table = cache.block_table(np.random.default_rng(args.seed + 1), len(tokens))
    backend = MooncakeBackend.from_master(args.master, global_segment_size=0)
    try:
        started = time.perf_counter()
        result = run(store_prompt(cache, backend, request["model"], tokens, table))
        elapsed = time.perf_counter() - started
    finally:
        backend.close()  # the values stay: they live in the router's segment
    chunks = len(tokens) // CHUNK_TOKENS
    manifest = {
        "chunks": chunks,
        "stored": result.stored,
        "skipped": result.skipped,
        "failed": result.failed,
        "checksums": cache.checksums(table, chunks),
    }
    (args.workdir / "prefill.json").write_text(json.dumps(manifest))
    mib = result.stored * cache.nbytes_per_chunk / 2**20
    say(
        f"prefill: stored {result.stored} chunks (skipped {result.skipped}, failed {result.failed}) of "
        f"{len(tokens)} tokens, {mib:.1f} MiB, in {elapsed * 1e3:.0f} ms"
    )
    if not result.ok:
        say(f"prefill: store failed for chunks {result.failed_chunks}: errors {dict(result.errors)}")
        return 1
    return 0


# -- decode ----------------------------------------------------------------------------------------


def decode(args: argparse.Namespace) -> int:
    request = json.loads((args.workdir / "request.json").read_text())
    manifest = json.loads((args.workdir / "prefill.json").read_text())
    tokens: list[int] = request["tokens"]
    cache = PagedKVCache(DECODE_BLOCKS, seed=None)
    table = cache.block_table(np.random.default_rng(args.seed + 2), len(tokens))
    prompt = HashedPrompt.from_tokens(tokens, CHUNK_TOKENS)  # hashed once, for lookup and load
    backend = MooncakeBackend.from_master(args.master, global_segment_size=0)
    try:
        with ThreadedKVWorker(
            cache.layouts, backend, namespace=request["model"], chunk_tokens=CHUNK_TOKENS
        ) as worker:
            hit = worker.lookup(prompt)
            started = time.perf_counter()
            loaded = worker.load(prompt, table).result(timeout=args.timeout)
            elapsed = time.perf_counter() - started
    finally:
        backend.close()
    chunks = manifest["chunks"]
    say(
        f"decode: lookup found {hit} of {len(tokens)} tokens; loaded {loaded.loaded_chunks} chunks "
        f"({loaded.loaded_tokens} tokens) into other blocks in {elapsed * 1e3:.0f} ms"
    )
    if args.simulate_corruption is not None:
        per = CHUNK_TOKENS // GROUPS[0].block_size
        block = int(table[0][args.simulate_corruption * per])
        cache.cache[0].regions[0][block, 0] ^= 1
        say(f"decode: flipped one bit of chunk {args.simulate_corruption} (--simulate-corruption)")

    mismatches = 0
    if loaded.loaded_chunks != chunks or not loaded.ok:
        say(
            f"decode: MISMATCH: {loaded.loaded_chunks} of {chunks} chunks loaded; "
            f"failed blocks {loaded.failed_block_ids}, errors {dict(loaded.errors)}"
        )
        mismatches += 1
    ours = cache.checksums(table, loaded.loaded_chunks)
    for group, (spec, expected, got) in enumerate(zip(GROUPS, manifest["checksums"], ours, strict=True)):
        for chunk, (want, have) in enumerate(zip(expected[: len(got)], got, strict=True)):
            if want != have:
                say(f"decode: MISMATCH in group {group} ({spec.name}), chunk {chunk}: {have} != {want}")
                mismatches += 1
    if mismatches:
        return MISMATCH
    say(
        f"decode: verified {chunks} of {chunks} chunks x {len(GROUPS)} groups "
        f"({chunks * cache.nbytes_per_chunk / 2**20:.1f} MiB) against the prefill checksums: OK"
    )
    return 0


# -- the router and storage node -------------------------------------------------------------------


def run_child(role: str, args: argparse.Namespace, address: str, workdir: Path) -> int:
    """Run one engine as a fresh interpreter; its Mooncake log goes to a file, shown if it fails."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--role", role, "--master", address,
        "--workdir", str(workdir), "--seed", str(args.seed), "--timeout", str(args.timeout),
        "--chunks", str(args.chunks),
    ]  # fmt: skip
    if role == "decode" and args.simulate_corruption is not None:
        command += ["--simulate-corruption", str(args.simulate_corruption)]
    log_path = workdir / f"{role}.log"
    with log_path.open("wb") as log:
        try:
            code = subprocess.run(command, stderr=log, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            say(f"router: {role} did not finish within {args.timeout:.0f} s")
            code = 124
    if code not in (0, MISMATCH):
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        say("\n  ".join([f"router: {role} exited with status {code}; the end of its log:", *tail]))
    return code


def router(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:  # unwinds in reverse: workdir, storage client, master
        if args.master:
            address = args.master
            say(f"router: using the mooncake_master at {address}")
        else:
            master = stack.enter_context(MooncakeMaster())
            address = master.address
            say(f"router: started mooncake_master (pid {master.pid}) on {address}")
        try:
            storage = MooncakeBackend.from_master(address, global_segment_size=args.segment)
        except BackendUnavailableError as exc:
            say(f"router: no store to run on: {exc}")
            return 1
        stack.callback(storage.close)
        say(f"router: storage client mounted a {args.segment} global segment; it holds the KV")
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aiokv-prefill-decode-")))

        rng = np.random.default_rng(args.seed)
        num_tokens = args.chunks * CHUNK_TOKENS + CHUNK_TOKENS // 3  # a partial last chunk: never stored
        request = {
            "model": f"example-model-{uuid.uuid4().hex[:8]}",  # fresh keys on a long-running master
            "tokens": rng.integers(0, 32_000, size=num_tokens).tolist(),
        }
        (workdir / "request.json").write_text(json.dumps(request))
        say(f"router: prompt of {num_tokens} tokens for {request['model']}")

        code = run_child("prefill", args, address, workdir)
        if code == 0:
            code = run_child("decode", args, address, workdir)
        say(f"router: prefill -> decode {'OK' if code == 0 else 'FAILED'}")
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", help="HOST:PORT of a running mooncake_master (default: start one)")
    parser.add_argument("--chunks", type=int, default=24, help="whole chunks of the prompt (default: 24)")
    parser.add_argument("--segment", default="256MiB", help="the router's global segment (default: 256MiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt and the prefill KV")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each engine may take")
    parser.add_argument("--simulate-corruption", type=int, metavar="CHUNK", help="flip a loaded bit")
    parser.add_argument("--role", choices=ROLES, default="router", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.chunks < 1:
        parser.error("--chunks must be at least 1")
    if args.simulate_corruption is not None and not 0 <= args.simulate_corruption < args.chunks:
        parser.error(f"--simulate-corruption must name a chunk in [0, {args.chunks})")
    if args.role != "router" and (args.master is None or args.workdir is None):
        parser.error("--role prefill/decode is started by the router with --master and --workdir")
    return {"router": router, "prefill": prefill, "decode": decode}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
