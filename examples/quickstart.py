"""The shortest complete round trip with aiokv: store a prompt's KV blocks, look it up, load it back.

Runs on the embedded ``MemoryBackend`` (no server):

    python examples/quickstart.py
"""

from __future__ import annotations

import sys

import numpy as np

import aiokv


async def main() -> int:
    # An engine's paged KV cache: 2 layers x (K, V) = 4 regions, each 32 blocks of 16 tokens
    # (8 heads x 64 dims, float16). Blocks 0-15 hold a prefill's KV; blocks 16-31 are free (zeros).
    rng = np.random.default_rng(0)
    cache = [np.zeros((32, 16, 8, 64), dtype=np.float16) for _ in range(4)]
    for region in cache:
        region[:16] = rng.standard_normal((16, 16, 8, 64))
    layout = aiokv.KVLayout(
        base_addrs=[region.ctypes.data for region in cache],
        block_lens=[cache[0][0].nbytes],  # bytes of one block of one region
        block_size=16,
        num_blocks=32,
        dtype="float16",
    )
    prompt = rng.integers(0, 32_000, size=200)  # 200 tokens: 3 whole chunks of 64, plus 8 tokens

    backend = aiokv.MemoryBackend()  # the embedded store; aiokv.MooncakeBackend(config) for Mooncake
    async with aiokv.KVWorker(layout, backend, namespace="quickstart", chunk_tokens=64) as worker:
        # The prefill's blocks for the prompt, one list per KV-cache group (here one group).
        stored = await worker.store(prompt, [np.arange(0, 12)])
        hit = await worker.lookup(prompt)  # leading tokens whose chunks are stored
        loaded = await worker.load(prompt[:hit], [np.arange(16, 28)])  # into other, free blocks

    same = all(np.array_equal(region[16:28], region[0:12]) for region in cache)
    print(f"stored : {stored.stored} chunks written, {stored.skipped} skipped, {stored.failed} failed")
    print(f"lookup : {hit} of {prompt.size} tokens are in the store")
    print(f"loaded : {loaded.loaded_tokens} tokens, blocks to recompute: {loaded.failed_block_ids}")
    print(f"verify : blocks 16-27 equal blocks 0-11 byte for byte: {'OK' if same else 'MISMATCH'}")
    ok = same and stored.stored == 3 and hit == 192 and loaded.loaded_tokens == 192 and loaded.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(aiokv.run(main()))  # asyncio.run on uvloop when it is installed
