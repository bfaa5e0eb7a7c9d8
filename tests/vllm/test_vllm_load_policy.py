"""The load policy on real engines over a throttled link: a hit the store delivers slower than the engine
recomputes it is declined, a fast one is taken, and outputs stay right either way.

Two nodes in network namespaces (aiokv.testing.cluster): node 0 holds the Mooncake segment, node 1 runs
a recompute engine and an AiokvConnector engine (benchmarks/vllm_throttle.py, the benchmark's own code
with a small setting). The link into node 1 is first at full speed, then throttled by a ``tbf`` qdisc to
40 Mbit/s: ~6 s for a hit's 29.4 MB (16 KiB of KV per token), where the engine recomputes it in a
fraction of a second (a few seconds on 2 busy cores). The test asserts decisions (declined
tokens and why, cached tokens) and outputs, never a speed.
"""

from __future__ import annotations

import pytest

from tests.cluster.support import require_cluster
from tests.vllm.support import BLOCK, assert_same_greedy, greedy_tolerance, require_vllm

pytestmark = [pytest.mark.cluster, pytest.mark.mooncake]

# 15 full blocks and a last partial block: a 2,000-token hit. Long enough that a full-speed load clearly
# beats recomputing on any CPU: with AMX the engine prefills 1,000 tokens in ~52 ms, and the policy's
# estimate of their load (~34 ms with a step) was too close for one cold first load not to tip it.
TOKENS = 2000
PROMPTS = 3
SLOW_MBIT = 40


def test_a_slow_hit_is_declined_and_a_fast_one_taken() -> None:
    require_vllm()
    require_cluster()
    from benchmarks.vllm_throttle import run

    report = run(tokens=TOKENS, prompts=PROMPTS, rates=[None, SLOW_MBIT], configs=["recompute", "aiokv"])
    hit = TOKENS
    computed = report["stored"]["recompute"]
    # Controls (pairs that differ only by the CPU's numerics): vLLM's own prefix-cache hits against the
    # full computes, the two engines' full computes, and vLLM's prefix cache leaving one token to
    # compute, as the whole-prompt hits below do (another kernel path on AMX CPUs).
    controls = [*zip(report["prefix_hits"], computed, strict=True)]
    controls += [*zip(report["stored"]["aiokv"], computed, strict=True)]
    for cold, warm in report["one_token_left"]:
        assert cold["cached_tokens"] == 0 and warm["cached_tokens"] == TOKENS // BLOCK * BLOCK, (cold, warm)
        controls.append((warm, cold))
    tolerance = greedy_tolerance(controls)
    full, slow = report["rows"]["aiokv"]
    assert full["rate_mbit"] == "full" and slow["rate_mbit"] == SLOW_MBIT

    # Full speed: every hit is taken whole.
    assert full["cached_tokens"] == [hit] * PROMPTS, full
    assert not full["policy"].get("declined_tokens"), full["policy"]

    # Throttled: the first request may still load (the estimate is from full speed; a load already
    # submitted is never revoked), and its load shows how slow the store now is; every later one is
    # declined for the store's speed and computes its prompt whole (or all but one chunk, if the
    # machine was slow enough between requests for the estimate to go stale and a probe to load it).
    assert slow["cached_tokens"][0] == hit, slow  # taken on the full-speed estimate, landed whole
    declined = slow["policy"]
    probes = declined.get("probe_loads", 0)
    assert declined.get("declined_requests", 0) >= PROMPTS - 1, declined
    assert declined.get("declined_tokens_slow_store", 0) >= (PROMPTS - 1) * hit - probes * BLOCK, declined
    assert all(cached in (0, BLOCK) for cached in slow["cached_tokens"][1:]), slow
    assert slow["cached_tokens"][1:].count(BLOCK) == probes <= 1, slow
    estimates = slow["estimates"]
    assert estimates["load_bytes_per_s"] < SLOW_MBIT * 1e6 / 8 * 1.5, estimates  # the throttle, learnt

    # Outputs: loaded or recomputed, each equal to the recompute's.
    for row in (full, slow):
        for n, output in enumerate(row["outputs"]):
            assert_same_greedy(output, computed[n], tolerance, f"prompt {n} at {row['rate_mbit']} Mbit/s")
