"""Cross-node figures in a private namespace world (see :mod:`aiokv.testing.cluster`).

1. Throughput: a prompt (default 128 MiB) stored by node 1 into node 0's segment and loaded by node 2,
   through each node's ``KVWorker`` and by direct backend batch calls over the same (address, size)
   pairs, for one-block chunks and 16-block chunks (consecutive blocks: one region per cache region).
   Best of ``--rounds``; worker/direct as a ratio; bytes verified once per geometry.
2. Recovery: a segment node SIGKILLed (time until the master drops it and a re-store makes the prompt
   readable again) and a master restart (how fast requests fail during the outage; time from the restart
   until the same worker stores and loads again).

Run as root or inside ``unshare -rn``: ``python -m benchmarks cluster [--mib 128] [--rounds 3]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from aiokv.testing.cluster.client import NodeClient, node_config
from aiokv.testing.cluster.world import ClusterWorld, world_unavailable_reason

from .report import finish_suite

REGIONS = 64
BLOCK_LEN = 16 << 10
BLOCK_SIZE = 16


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _throughput(world: ClusterWorld, blocks_per_chunk: int, total_mib: int, rounds: int) -> dict[str, Any]:
    chunk_bytes = REGIONS * BLOCK_LEN * blocks_per_chunk
    chunks = max(1, (total_mib << 20) // chunk_bytes)
    num_blocks = chunks * blocks_per_chunk
    geometry: dict[str, Any] = {
        "regions": REGIONS,
        "block_len": BLOCK_LEN,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": BLOCK_SIZE * blocks_per_chunk,
        "num_blocks": num_blocks,
    }
    ids = list(range(num_blocks))
    nbytes = chunks * chunk_bytes
    writer = NodeClient(world, 1, node_config(world, 1, **geometry))
    reader = NodeClient(world, 2, node_config(world, 2, loop="uvloop", **geometry))
    best: dict[str, float] = {}
    try:
        for round_ in range(rounds):
            seed = 100 * blocks_per_chunk + round_
            prompt: dict[str, Any] = {"seed": seed, "chunks": chunks, "block_ids": ids}
            writer.result("fill", **prompt)
            # Who goes first alternates per round, so neither side always meets cold connections.
            order = ["worker_store", "direct_put", "worker_load", "direct_get"]
            if round_ % 2:
                order = ["direct_put", "worker_store", "direct_get", "worker_load"]
            timings = {name: _step(name, writer, reader, prompt, verify=round_ == 0) for name in order}
            for name, result in timings.items():
                if result.get("failed") or result.get("loaded_tokens", chunks * geometry["chunk_tokens"]) < (
                    chunks * geometry["chunk_tokens"]
                ):
                    raise RuntimeError(f"{name} did not move every chunk: {result}")
                if "verdicts" in result and set(result["verdicts"]) != {"ok"}:
                    raise RuntimeError("the loaded bytes differ from the stored bytes")
            # The worker's store time includes its existence check, as an engine would see it.
            seconds = {
                "worker_store": timings["worker_store"]["transfer_s"],
                "direct_put": timings["direct_put"]["transfer_s"],
                "worker_load": timings["worker_load"]["transfer_s"],
                "direct_get": timings["direct_get"]["transfer_s"],
            }
            for name, value in seconds.items():
                best[name] = min(best.get(name, float("inf")), value)
            writer.result("remove", tag="d", **prompt)
            _progress(f"  {blocks_per_chunk}-block chunks, round {round_ + 1}: " + _rates(seconds, nbytes))
    finally:
        writer.close()
        reader.close()
    rates = {name: nbytes / seconds / 1e9 for name, seconds in best.items()}
    return {
        "blocks_per_chunk": blocks_per_chunk,
        "chunks": chunks,
        "region_bytes": BLOCK_LEN * blocks_per_chunk,
        "regions_per_chunk": REGIONS,
        "bytes": nbytes,
        "gb_per_s": rates,
        "store_ratio": rates["worker_store"] / rates["direct_put"],
        "load_ratio": rates["worker_load"] / rates["direct_get"],
    }


def _step(name: str, writer: NodeClient, reader: NodeClient, prompt: dict[str, Any], verify: bool) -> Any:
    if name == "worker_store":
        return writer.result("store", fill=False, **prompt, wait_s=300)
    if name == "direct_put":
        return writer.result("direct", direct_op="put", tag="d", **prompt, wait_s=300)
    if name == "worker_load":
        return reader.result("load", verify=verify, **prompt, wait_s=300)
    return reader.result("direct", direct_op="get", tag="d", **prompt, wait_s=300)


def _rates(seconds: dict[str, float], nbytes: int) -> str:
    return ", ".join(f"{name} {nbytes / value / 1e9:.2f} GB/s" for name, value in seconds.items())


def _node_loss(world: ClusterWorld) -> dict[str, float]:
    victim = NodeClient(world, 0, node_config(world, 0, segment_size=64 << 20))
    keeper = NodeClient(world, 1, node_config(world, 1, segment_size=64 << 20))
    writer = NodeClient(world, 2, node_config(world, 2))
    chunks, ids = 64, list(range(64))
    try:
        writer.result("store", seed=7, chunks=chunks, block_ids=ids)
        victim.kill()
        killed = time.monotonic()
        first = writer.call("load", seed=7, chunks=chunks, block_ids=ids, timeout=15)
        first_answer_s = time.monotonic() - killed
        while True:
            writer.result("store", seed=7, chunks=chunks, block_ids=ids)
            loaded = writer.result("load", seed=7, chunks=chunks, block_ids=ids, timeout=15)
            if loaded["loaded_tokens"] == chunks * 16:
                break
            if time.monotonic() - killed > 60:
                raise RuntimeError("the prompt was not readable again within 60 s of the node loss")
            time.sleep(0.25)
        return {
            "first_load_answer_s": first_answer_s,
            "first_load_loaded_tokens": first["result"]["loaded_tokens"] if first["ok"] else -1,
            "readable_again_after_restore_s": time.monotonic() - killed,
        }
    finally:
        keeper.kill()
        writer.kill()
        for node in (victim, keeper, writer):
            node.close(timeout=1)


def _master_restart(world: ClusterWorld) -> dict[str, float]:
    if world.master is None:
        raise RuntimeError("the world is not started")
    holder = NodeClient(world, 0, node_config(world, 0, segment_size=64 << 20))
    client = NodeClient(world, 1, node_config(world, 1))
    ids = list(range(16))
    figures: dict[str, float] = {}
    try:
        client.result("store", seed=1, chunks=16, block_ids=ids)
        world.master.kill()
        for op, seed in (("lookup", 1), ("store", 2), ("load", 1)):
            reply = client.call(op, seed=seed, chunks=16, block_ids=ids, timeout=30, wait_s=60)
            figures[f"{op}_fails_after_s"] = reply["elapsed_s"] if not reply["ok"] else -1.0
        world.master.start()
        restarted = time.monotonic()
        while True:
            reply = client.call("store", seed=3, chunks=16, block_ids=ids, timeout=15)
            if reply["ok"] and reply["result"]["stored"] == 16:
                loaded = client.result("load", seed=3, chunks=16, block_ids=ids, timeout=15)
                if loaded["loaded_tokens"] == 256:
                    break
            if time.monotonic() - restarted > 60:
                raise RuntimeError("the worker did not store again within 60 s of the master restart")
            time.sleep(0.1)
        figures["works_again_after_restart_s"] = time.monotonic() - restarted
        return figures
    finally:
        holder.kill()
        client.kill()
        holder.close(timeout=1)
        client.close(timeout=1)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks cluster", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--mib", type=int, default=128, help="prompt size in MiB (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds, best kept (default 3)")
    parser.add_argument("--skip-recovery", action="store_true", help="throughput only")
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every figure to this file")
    args = parser.parse_args(argv)
    reason = world_unavailable_reason()
    if reason is not None:
        print(f"benchmarks.cluster cannot run here: {reason}", file=sys.stderr)
        return 2
    return finish_suite(
        "cluster", lambda: _run(args.mib, args.rounds, args.skip_recovery), _print_report, args.json
    )


def _print_report(report: dict[str, Any], out: TextIO) -> None:
    out.write(format_report(report) + "\n")


def _run(mib: int, rounds: int, skip_recovery: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"mib": mib, "rounds": rounds, "throughput": []}
    segment = ((mib + 64) << 20) * 2  # the worker's and the direct keys side by side
    with ClusterWorld(3) as world:
        holder = NodeClient(world, 0, node_config(world, 0, segment_size=segment))
        try:
            for blocks_per_chunk in (1, 16):
                _progress(f"throughput, {blocks_per_chunk}-block chunks")
                report["throughput"].append(_throughput(world, blocks_per_chunk, mib, rounds))
        finally:
            holder.close()
    if not skip_recovery:
        _progress("recovery: node loss")
        with ClusterWorld(3) as world:
            report["node_loss"] = _node_loss(world)
        _progress("recovery: master restart")
        with ClusterWorld(3) as world:
            report["master_restart"] = _master_restart(world)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"cross-node throughput, {report['mib']} MiB prompt, best of {report['rounds']} (GB/s)"]
    lines.append("chunk                worker store  direct put  ratio   worker load  direct get  ratio")
    for row in report["throughput"]:
        rate = row["gb_per_s"]
        label = f"{row['blocks_per_chunk']} block(s), {row['region_bytes'] >> 10} KiB"
        store = f"{rate['worker_store']:>12.2f} {rate['direct_put']:>11.2f} {row['store_ratio']:>6.2f}"
        load = f"{rate['worker_load']:>12.2f} {rate['direct_get']:>11.2f} {row['load_ratio']:>6.2f}"
        lines.append(f"{label:<20} {store} {load}")
    for section in ("node_loss", "master_restart"):
        if section in report:
            figures = ", ".join(f"{name} {value:.2f}" for name, value in report[section].items())
            lines.append(f"{section}: {figures}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
