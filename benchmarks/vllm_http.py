"""``python -m benchmarks vllm --http``: connectors compared under vLLM's OpenAI server, over HTTP.

Real servers (``aiokv.testing.vllm_server``: the API server, engine core and worker processes of
vLLM's default multiprocess engine, ``--no-enable-prefix-caching`` so every hit is the connector's)
are driven by concurrent clients that stream ``/v1/completions`` with token-id prompts: the time to
first token is the client's, from sending the request to the first streamed token.

Per configuration, on a fresh Mooncake store (a master and a holder process owning the segment; the
servers are pure clients): a storing server answers each shared prefix once (unaligned lengths, by
default 2,000 / 6,000 / 7,777 tokens) and is stopped once its stores are in; a fresh loading server
then gets ``--clients`` concurrent clients, each sending ``--requests`` prompts: a shared prefix plus a
suffix of its own (``--suffix-tokens``; sizes in turn). ``recompute`` (no connector) runs the loading
phase alone. Reported per configuration: TTFT p50 and p99, requests/s, the hit tokens
(``cached_tokens``) per prefix size, the CPU seconds of every server process, and the greedy tokens
compared with recompute's; ratios against recompute and between the connectors. Configurations run in
one invocation, one server at a time; with ``--rounds N`` the connector configurations run N times in
alternating order (a shared machine's load then weighs on each alike) and the figures are medians,
the ratios medians of the per-round ratios with their range.

Configurations are pluggable (:data:`CONFIGS`): each names its KV transfer config and whether the
loading server is a fresh one (a shared store) or the storing one (a tier inside the server: aiokv's
embedded and tiered setups, whose hits come from host memory; ``tiered / aiokv`` is then a local-tier
hit against the same hit from Mooncake). ``unverified`` is aiokv on Mooncake with ``verify_values``
off: ``aiokv / unverified`` is what checksummed values cost under a server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokv.testing.vllm_server import DEFAULT_ARGS, Completion, VllmServer, running_server

from .vllm_phases import (
    EVENTS_ENV,
    format_phase_table,
    inside_view,
    phases_by_request,
    read_events,
    timed,
)
from .vllm_phases import summary as summary_of_phases
from .vllm_setup import kv_transfer_config, mooncake_config, rerun_in_namespace, service_store
from .vllm_workload import BLOCK_SIZE, MODEL_SHAPE

logger = logging.getLogger("benchmarks.vllm")

# Stats on: vLLM collects the connector's counters (Prometheus) only with them.
SERVER_ARGS = tuple(arg for arg in DEFAULT_ARGS if arg != "--disable-log-stats")
STORE_WAIT_S = 120.0  # the storing server's stores must land by then (seen: seconds)


@dataclass(frozen=True)
class Config:
    """One configuration: its KV transfer config from the Mooncake JSON (None: no connector), and
    whether the loading server is a fresh one on the shared store."""

    transfer: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]
    fresh_loader: bool = True
    needs_store: bool = True  # a Mooncake store (a master and a holder) for its connector
    disk: bool = False  # a disk tier in a directory of the run: the loading server restarts on it
    kv_events: bool = False  # vLLM's KV events published (over ZeroMQ, to no subscriber)
    prefix_caching: bool = False  # vLLM's own prefix cache on (every other configuration runs it off)
    # aiokv attached to the store's client service through shared memory (the documented setup on
    # the store's host); otherwise a TCP client of it, as vLLM's connector is.
    attach: bool = False


def _aiokv_tier(backend: str) -> Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]:
    """AiokvConnector with a host-memory tier in each server (``"memory"``: alone; ``"tiered"``: in
    front of Mooncake): its hits come from the server that stored them."""

    def transfer(store: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any] | None:
        config = kv_transfer_config("aiokv", store, {**extra, "backend": backend})
        assert config is not None
        if backend in ("memory", "disk"):
            del config["kv_connector_extra_config"]["mooncake_config"]
        return config

    return transfer


CONFIGS: dict[str, Config] = {
    "recompute": Config(lambda store, extra: None, needs_store=False),
    # The floor: the prefixes computed once by the same server, then served from vLLM's prefix cache
    # (no KV moves at all; only each request's own tokens are computed).
    "prefix-cache": Config(
        lambda store, extra: None, fresh_loader=False, needs_store=False, prefix_caching=True
    ),
    "vllm": Config(lambda store, extra: kv_transfer_config("vllm", store)),
    "aiokv": Config(lambda store, extra: kv_transfer_config("aiokv", store, extra), attach=True),
    # aiokv as a TCP client of the store, as vLLM's connector is (the transport aside, the same code).
    "aiokv-tcp": Config(lambda store, extra: kv_transfer_config("aiokv", store, extra)),
    # Values not checksummed (what checksums cost: aiokv against this, same run).
    "unverified": Config(
        lambda store, extra: kv_transfer_config("aiokv", store, {**extra, "verify_values": False}),
        attach=True,
    ),
    "embedded": Config(_aiokv_tier("memory"), fresh_loader=False),
    # aiokv with vLLM's KV events on: what publishing its tiers' events costs (against aiokv).
    "aiokv-events": Config(
        lambda store, extra: kv_transfer_config("aiokv", store, extra), kv_events=True, attach=True
    ),
    # The disk tier: a fresh server on the storing server's directory (a restart) loads from it.
    "disk": Config(_aiokv_tier("disk"), needs_store=False, disk=True),
    "tiered": Config(_aiokv_tier("tiered"), fresh_loader=False, attach=True),
}


BUILT_IN = frozenset(CONFIGS)


def connector_store(config: Config, store: dict[str, Any], service: str) -> dict[str, Any]:
    """The Mooncake JSON a configuration's connector gets: attached to the client service at
    ``service`` (``Config.attach``), or the pure client's JSON every server finds in its environment."""
    return {**store, "client_service": service} if config.attach else store


def _variant(extra: dict[str, Any]) -> Config:
    """aiokv on Mooncake with ``extra`` merged into its extra config (``--variant``)."""
    return Config(lambda store, common: kv_transfer_config("aiokv", store, {**common, **extra}), attach=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks vllm --http",
        description="Connectors under vLLM's OpenAI server: TTFT p50/p99, requests/s and hit tokens for "
        "concurrent clients sharing prefixes, against recompute, in one run.",
    )
    parser.add_argument("--prompt-tokens", default="2000,6000,7777", help="shared prefix sizes")
    parser.add_argument("--suffix-tokens", type=int, default=100, help="own tokens after the prefix (100)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--requests", type=int, default=6, help="requests per client (default 6)")
    parser.add_argument("--output-tokens", type=int, default=16, help="greedy tokens per request (16)")
    parser.add_argument("--layers", type=int, default=MODEL_SHAPE["num_layers"], help="model layers (16)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (default 2)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {', '.join(CONFIGS)}")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="one more configuration: aiokv on Mooncake with JSON merged into its extra config (repeatable; "
        "compared with aiokv and vllm), e.g. --variant 'two-threads={\"executor_threads\": 2}'",
    )
    parser.add_argument("--aiokv-extra", type=json.loads, default={}, help="JSON merged into aiokv's extra")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the connector configurations this many times, in alternating order (recompute once): "
        "figures are medians over rounds, ratios medians of the per-round ratios with their range",
    )
    parser.add_argument(
        "--no-phases",
        action="store_true",
        help="load the connectors as they are, not the subclasses stamping each call (vllm_phases.py)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure and request here")
    parser.add_argument("--keep", type=Path, help="keep the model, configs and server logs here")
    parser.add_argument("--no-unshare", action="store_true", help="fail instead of re-running in unshare")
    return parser


def build_prompts(args: argparse.Namespace) -> tuple[dict[int, list[int]], list[list[list[int]]]]:
    """The shared prefixes by size, and each client's prompts (a prefix, sizes in turn, and a suffix
    of its own), seeded."""
    import random

    rng = random.Random(args.seed)
    vocab = MODEL_SHAPE["vocab_size"]

    def ids(count: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(count)]

    sizes = [int(size) for size in args.prompt_tokens.split(",") if size.strip()]
    prefixes = {size: ids(size) for size in sizes}
    clients = [
        [prefixes[sizes[(c + r) % len(sizes)]] + ids(args.suffix_tokens) for r in range(args.requests)]
        for c in range(args.clients)
    ]
    return prefixes, clients


def _stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from a ``/proc/.../stat`` line."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending += children.get(pid, [])
    return tree


def _process_tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and its descendants so far (exited threads included)."""
    total = 0.0
    for pid in _process_tree(root):
        with contextlib.suppress(OSError):
            total += _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    return total


def _thread_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds so far of every live thread under ``root``, summed by process and thread name
    (``/proc/PID/task/TID``: ``"VLLM::EngineCor/aiokv-transfer"``...)."""
    out: dict[str, float] = {}
    for pid in _process_tree(root):
        with contextlib.suppress(OSError):
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
                    name = stat[stat.index("(") + 1 : stat.rindex(")")]
                    key = f"{process}/{name.rstrip('0123456789_-')}"
                    out[key] = out.get(key, 0.0) + _stat_cpu_seconds(stat)
    return out


def drive(
    server: VllmServer, clients: list[list[list[int]]], output_tokens: int, store_pids: list[int]
) -> dict[str, Any]:
    """Every client sends its prompts one after the other, all clients at once, streaming. CPU is
    counted for the server's processes and, apart, for the store's (``store_pids``)."""

    def client(prompts: list[list[int]]) -> list[Completion]:
        return [server.complete(p, max_tokens=output_tokens, logprobs=None, stream=True) for p in prompts]

    cpu_before = _process_tree_cpu_seconds(server.process.pid)
    store_before = sum(map(_process_tree_cpu_seconds, store_pids))
    threads_before = _thread_cpu_seconds(server.process.pid)
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        done = list(pool.map(client, clients))
    wall = time.monotonic() - began
    cpu = _process_tree_cpu_seconds(server.process.pid) - cpu_before
    store_cpu = sum(map(_process_tree_cpu_seconds, store_pids)) - store_before
    threads = {
        name: seconds - threads_before.get(name, 0.0)
        for name, seconds in _thread_cpu_seconds(server.process.pid).items()
        if seconds - threads_before.get(name, 0.0) > 0
    }
    by_thread = dict(sorted(threads.items(), key=lambda item: -item[1]))
    return {
        "wall_s": wall,
        "server_cpu_s": cpu,
        "store_cpu_s": store_cpu,
        "server_cpu_s_by_thread": by_thread,
        "completions": done,
    }


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def figures(run: dict[str, Any], prefix_sizes: list[int], suffix: int) -> dict[str, Any]:
    completions = [c for client in run["completions"] for c in client]
    ttfts = [c.ttft_s for c in completions if c.ttft_s is not None]
    hits: dict[str, list[int]] = {}
    for c in completions:
        hits.setdefault(str(c.prompt_tokens - suffix), []).append(c.cached)
    return {
        "requests": len(completions),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "requests_per_s": len(completions) / run["wall_s"],
        "wall_s": run["wall_s"],
        "server_cpu_s": run["server_cpu_s"],
        "server_cpu_s_per_request": run["server_cpu_s"] / len(completions),
        # The store's process (Mooncake's client service) serves every connector's reads and writes.
        "store_cpu_s_per_request": run.get("store_cpu_s", 0.0) / len(completions),
        "cpu_s_per_request": (run["server_cpu_s"] + run.get("store_cpu_s", 0.0)) / len(completions),
        "hit_tokens": sum(c.cached for c in completions),
        "hit_tokens_by_prefix": {size: sorted(set(values)) for size, values in hits.items()},
        "full_blocks_by_prefix": {str(s): s // BLOCK_SIZE * BLOCK_SIZE for s in prefix_sizes},
    }


def run_config(
    name: str, args: argparse.Namespace, model: Path, workdir: Path, prompts: Any
) -> dict[str, Any]:
    prefixes, clients = prompts
    config = CONFIGS[name]
    with contextlib.ExitStack() as stack:
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_HOST_IP": "127.0.0.1"}
        env["MOONCAKE_REQUESTER_LOCAL_HOSTNAME"] = "127.0.0.1"
        transfer = None
        store_pids: list[int] = []
        if config.needs_store:
            # Room for every prompt's KV twice over (the loading server stores the suffixes' blocks).
            kv_per_token = 2 * MODEL_SHAPE["num_kv_heads"] * MODEL_SHAPE["head_dim"] * 2 * args.layers
            tokens = sum(map(len, prefixes.values())) + sum(len(p) for client in clients for p in client)
            segment = max(512 << 20, 2 * kv_per_token * tokens)
            address, service, service_pid = stack.enter_context(
                service_store(segment, workdir / f"{name}.mooncake_client.log")
            )
            store_pids.append(service_pid)
            store = mooncake_config(address)
            config_path = workdir / f"{name}.mooncake.json"
            config_path.write_text(json.dumps(store))
            env["MOONCAKE_CONFIG_PATH"] = str(config_path)
            transfer = config.transfer(connector_store(config, store, service), args.aiokv_extra)
        if config.disk:
            disk_path = Path(tempfile.mkdtemp(prefix=f"{name}.tier.", dir=workdir))
            extra = {"disk_path": str(disk_path), "disk_capacity": "8GiB", **args.aiokv_extra}
            transfer = config.transfer({}, extra)
        if transfer is not None and not args.no_phases:
            transfer = timed(transfer)
        events = {
            role: Path(tempfile.mkdtemp(prefix=f"{name}.{role}.", dir=workdir)) for role in ("store", "load")
        }
        server_args: tuple[str, ...] = SERVER_ARGS
        if config.kv_events:
            endpoint = f"ipc://{workdir / f'{name}.events.ipc'}"
            publisher = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
            server_args = (*server_args, "--kv-events-config", json.dumps(publisher))
        if config.prefix_caching:
            server_args = (
                *(a for a in server_args if a != "--no-enable-prefix-caching"),
                "--enable-prefix-caching",
            )

        def serve(role: str) -> contextlib.AbstractContextManager[VllmServer]:
            logger.info("%s: %s server starting", name, role)
            extra = ["--max-model-len", str(max(map(len, prefixes.values())) + args.suffix_tokens + 64)]
            # The stamps of the timed connectors (benchmarks.vllm_phases), importable from the checkout.
            stamps = {
                EVENTS_ENV: str(events[role]),
                "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
            }
            return running_server(
                model,
                workdir / f"{name}.{role}.log",
                kv_transfer_config=transfer,
                env={**env, **stamps},
                args=server_args,
                extra_args=extra,
            )

        result: dict[str, Any] = {"connector": transfer}
        loader = None
        loader_role = "load"
        if transfer is not None or config.prefix_caching:
            storer = stack.enter_context(serve("store")) if config.fresh_loader else None
            server = storer or stack.enter_context(serve("load"))
            for prefix in prefixes.values():
                server.complete(prefix, max_tokens=1, logprobs=None)
            # The stores land in the background: a prefix that hits on the storing server is in.
            result["store_wait_s"] = _wait_stored(server, prefixes)
            if storer is not None:
                storer.stop()  # SIGINT now; the stack's own stop later finds it gone
            else:
                loader, loader_role = server, "store"
        if loader is None:
            loader = stack.enter_context(serve("load"))
        # One warm-up request (not a shared prefix): the first request of a server pays one-off costs.
        loader.complete(list(range(3, 3 + 4 * BLOCK_SIZE)), max_tokens=2, logprobs=None)
        logger.info("%s: %d clients x %d requests", name, len(clients), len(clients[0]))
        aiokv = transfer is not None and "Aiokv" in transfer["kv_connector"]
        before = loader.metrics() if aiokv else {}
        began = time.monotonic()
        result["run"] = drive(loader, clients, args.output_tokens, store_pids)
        if aiokv:
            _flush_worker_counters(loader)
        # AiokvConnector's counters over the loading server's life (warm-up included): lookups
        # answered "ask again", chunks loaded, ...; its own phase figures over the driven requests.
        result["aiokv_counters"] = loader.metrics() if aiokv else {}
        result["aiokv_inside"] = inside_view(before, result["aiokv_counters"]) if aiokv else {}
        stamps = [event for event in read_events(events[loader_role]) if event[0] >= began]
        result["hit_phases"] = phases_by_request(stamps)
        return result


def _flush_worker_counters(server: VllmServer) -> None:
    """The workers report aiokv's counters at most every second, and only as the engine steps: two
    short requests of fresh tokens (stores only, no load), a second apart, bring them in."""
    for n in range(2):
        time.sleep(1.2)
        fresh = [(7 * n + 11 * i) % (MODEL_SHAPE["vocab_size"] - 3) + 3 for i in range(2 * BLOCK_SIZE)]
        server.complete(fresh, max_tokens=1, logprobs=None)


def _wait_stored(server: VllmServer, prefixes: dict[int, list[int]]) -> float:
    """Seconds until every prefix hits on ``server`` (without prefix caching every hit is the
    connector's) and the hits stopped growing (stores land chunk by chunk), or STORE_WAIT_S."""
    began = time.monotonic()
    previous: list[int] = []
    while time.monotonic() - began < STORE_WAIT_S:
        hits = [server.complete(p, max_tokens=1, logprobs=None).cached for p in prefixes.values()]
        if all(hits) and hits == previous:
            return time.monotonic() - began
        previous = hits
        time.sleep(1)
    logger.warning("stores not all in after %.0f s", STORE_WAIT_S)
    return time.monotonic() - began


def compare_tokens(rounds: list[dict[str, Any]], baseline: str = "recompute") -> dict[str, Any]:
    """Per configuration, over every round: requests whose greedy tokens equal the baseline's, and the
    first few that do not (round, client, request, first differing position, hit)."""
    reference = next(results[baseline] for results in rounds if baseline in results)
    want = [[c.tokens for c in client] for client in reference["run"]["completions"]]
    out: dict[str, Any] = {}
    for n, results in enumerate(rounds):
        for name, result in results.items():
            tally = out.setdefault(name, {"equal": 0, "different": 0, "examples": []})
            for c, client in enumerate(result["run"]["completions"]):
                for r, completion in enumerate(client):
                    expected = want[c][r]
                    if completion.tokens == expected:
                        tally["equal"] += 1
                        continue
                    position = next(
                        (
                            i
                            for i, (a, b) in enumerate(zip(completion.tokens, expected, strict=False))
                            if a != b
                        ),
                        min(len(completion.tokens), len(expected)),
                    )
                    tally["different"] += 1
                    if len(tally["examples"]) < 8:
                        example = {"client": c, "request": r, "position": position, "hit": completion.cached}
                        tally["examples"].append({"round": n, **example})
    return out


def format_table(summary: dict[str, Any]) -> str:
    names = list(summary["figures"])
    rows = [
        ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
        ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("server CPU s/request", "server_cpu_s_per_request", "{:.2f}"),
        ("store CPU s/request", "store_cpu_s_per_request", "{:.2f}"),
        ("server+store CPU s/request", "cpu_s_per_request", "{:.2f}"),
        ("hit tokens (all requests)", "hit_tokens", "{:.0f}"),  # a median of two rounds may be x.5
    ]
    lines = [f"{'':28}" + "".join(f"{name:>14}" for name in names)]
    for label, key, fmt in rows:
        lines.append(f"{label:28}" + "".join(f"{fmt.format(summary['figures'][n][key]):>14}" for n in names))
    for size in summary["figures"][names[0]]["hit_tokens_by_prefix"]:
        cells = [
            ",".join(map(str, summary["figures"][n]["hit_tokens_by_prefix"].get(size, []))) for n in names
        ]
        lines.append(f"{'hit per request, ' + size:28}" + "".join(f"{cell:>14}" for cell in cells))
    deferrals = [summary["figures"][n].get("lookups_deferred") for n in names]
    cells = ["-" if value is None else f"{value:.0f}" for value in deferrals]
    lines.append(f"{'lookups deferred (server)':28}" + "".join(f"{cell:>14}" for cell in cells))
    lines.append(
        f"{'greedy tokens = recompute':28}"
        + "".join(
            f"{summary['tokens'][n]['equal']}/{summary['figures'][n]['requests']}".rjust(14) for n in names
        )
    )
    spans = summary.get("ratio_ranges", {})
    for label, ratios in summary["ratios"].items():
        cells = []
        for key, value in ratios.items():
            low, high = spans.get(label, {}).get(key, (value, value))
            cells.append(f"{key} {value:.2f}" + (f" ({low:.2f}-{high:.2f})" if high > low else ""))
        lines.append(f"{label}: " + ", ".join(cells))
    return "\n".join(lines) + "\n"


def ratios(figures_by_name: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each configuration against recompute and against the floor (vLLM's prefix cache), aiokv against
    vLLM's connector, the host tiers against aiokv on Mooncake (lower TTFT and CPU, higher requests/s
    are better), and what aiokv adds to the floor's TTFT against what vLLM's connector adds."""
    keys = ("ttft_p50_s", "ttft_p99_s", "requests_per_s", "server_cpu_s_per_request", "cpu_s_per_request")
    pairs = [(name, "recompute") for name in figures_by_name if name != "recompute"]
    floor = "prefix-cache"
    pairs += [(name, floor) for name in figures_by_name if name not in ("recompute", floor)]
    # A host tier's hit against the same hit from Mooncake (a host tier is there to answer faster).
    pairs += [
        (a, b)
        for a, b in (
            ("aiokv", "vllm"),
            ("aiokv-tcp", "vllm"),
            ("aiokv", "aiokv-tcp"),
            ("aiokv", "unverified"),
            ("tiered", "aiokv"),
            ("embedded", "aiokv"),
            ("disk", "aiokv"),
            # The host tiers against a hit over the network (TCP), as from a store on another host.
            ("tiered", "aiokv-tcp"),
            ("disk", "aiokv-tcp"),
            ("aiokv-events", "aiokv"),
            ("disk", "embedded"),
        )
    ]
    out = {
        f"{a} / {b}": {k: figures_by_name[a][k] / figures_by_name[b][k] for k in keys}
        for a, b in pairs
        if a in figures_by_name and b in figures_by_name
    }
    variants = [name for name in figures_by_name if name not in BUILT_IN]
    out.update(
        {
            f"{a} / {b}": {k: figures_by_name[a][k] / figures_by_name[b][k] for k in keys}
            for a in variants
            for b in ("aiokv", "vllm")
            if b in figures_by_name
        }
    )
    if floor in figures_by_name and "vllm" in figures_by_name:
        for name in ("aiokv", "aiokv-tcp", "unverified", "tiered", "embedded", "disk", *variants):
            if name not in figures_by_name:
                continue
            above = {}
            for key in ("ttft_p50_s", "ttft_p99_s"):
                theirs = figures_by_name["vllm"][key] - figures_by_name[floor][key]
                # vLLM's connector within 2% of the floor (or below it) leaves no difference to divide.
                if theirs > 0.02 * figures_by_name[floor][key]:
                    above[key] = (figures_by_name[name][key] - figures_by_name[floor][key]) / theirs
            if above:
                out[f"{name} / vllm, TTFT above the floor"] = above
    return out


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(args_list)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from .cli import _private_namespace

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for variant in args.variant:
        name, _, extra = variant.partition("=")
        if not name or name in CONFIGS or not extra:
            raise SystemExit(f"--variant wants NAME=JSON with a new name, got {variant!r}")
        CONFIGS[name] = _variant(json.loads(extra))
        configs.append(name)
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or "recompute" not in configs:
        raise SystemExit(f"--configs must name recompute and any of {', '.join(CONFIGS)}; got {unknown}")
    if not _private_namespace():
        return 2 if args.no_unshare else rerun_in_namespace(["--http", *args_list])
    prompts = build_prompts(args)
    with contextlib.ExitStack() as stack:
        workdir = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aiokv-http-")))
        workdir.mkdir(parents=True, exist_ok=True)
        from aiokv.testing.tiny_model import write_tiny_llama, write_word_tokenizer

        shape = dict(MODEL_SHAPE, num_layers=args.layers)
        model = write_word_tokenizer(write_tiny_llama(workdir / "model", **shape, seed=args.seed))
        rounds = [
            {name: run_config(name, args, model, workdir, prompts) for name in order}
            for order in round_orders(configs, args.rounds)
        ]
    sizes = list(prompts[0])
    per_round = [
        {n: {**figures(r["run"], sizes, args.suffix_tokens), **deferred(r)} for n, r in res.items()}
        for res in rounds
    ]
    summary: dict[str, Any] = {
        "figures": median_figures(per_round, configs),
        "tokens": compare_tokens(rounds),
        "setup": {"model": shape, "args": vars(args) | {"json": None, "keep": None}},
    }
    summary["ratios"], summary["ratio_ranges"] = median_ratios(per_round)
    summary["hit_phases"] = {
        name: summary_of_phases(
            {f"{n}:{req}": p for n, res in enumerate(rounds) for req, p in res[name]["hit_phases"].items()}
        )
        for name in configs
        if any(name in res and res[name]["hit_phases"] for res in rounds)
    }
    summary["aiokv_inside"] = {
        name: {
            key: statistics.median(
                r[name]["aiokv_inside"][key] for r in rounds if key in r[name].get("aiokv_inside", {})
            )
            for key in next(r[name]["aiokv_inside"] for r in rounds if name in r)
        }
        for name in configs
        if any(r.get(name, {}).get("aiokv_inside") for r in rounds)
    }
    if args.json is not None:
        raw = [
            {
                n: {
                    **r,
                    "run": {
                        **r["run"],
                        "completions": [[vars(c) for c in cl] for cl in r["run"]["completions"]],
                    },
                }
                for n, r in res.items()
            }
            for res in rounds
        ]
        summary["per_round"] = per_round
        args.json.write_text(json.dumps({**summary, "raw": raw}, indent=1, default=str))
    sys.stdout.write(format_table(summary))
    sys.stdout.write(format_phase_table(summary["hit_phases"]))
    for name, inside in summary["aiokv_inside"].items():
        sys.stdout.write(
            f"{name}, inside aiokv: " + ", ".join(f"{k} {v:.1f}" for k, v in inside.items()) + "\n"
        )
    return 0


def deferred(result: dict[str, Any]) -> dict[str, float]:
    """The loading server's lookups answered "ask again" (AiokvConnector configurations only)."""
    counters = result.get("aiokv_counters") or {}
    return {"lookups_deferred": counters.get("vllm:aiokv_lookups_deferred_total", 0.0)} if counters else {}


def round_orders(configs: list[str], rounds: int) -> list[list[str]]:
    """recompute once, first (the token reference; its TTFT is several times any hit's), then the
    connector configurations in turn, reversed every other round so that none always runs last."""
    others = [name for name in configs if name != "recompute"]
    return [
        (["recompute"] if r == 0 else []) + (others if r % 2 == 0 else others[::-1]) for r in range(rounds)
    ]


def median_figures(
    per_round: list[dict[str, dict[str, Any]]], configs: list[str]
) -> dict[str, dict[str, Any]]:
    """Per configuration, each number's median over the rounds it ran in; hits: every round's."""
    out: dict[str, dict[str, Any]] = {}
    for name in configs:
        runs = [figs[name] for figs in per_round if name in figs]
        merged: dict[str, Any] = dict(runs[0])
        for key, value in runs[0].items():
            if isinstance(value, int | float):
                merged[key] = statistics.median(run[key] for run in runs)
        merged["hit_tokens_by_prefix"] = {
            size: sorted({hit for run in runs for hit in run["hit_tokens_by_prefix"].get(size, [])})
            for size in runs[0]["hit_tokens_by_prefix"]
        }
        merged["requests"] = sum(run["requests"] for run in runs)
        merged["rounds"] = len(runs)
        out[name] = merged
    return out


def median_ratios(
    per_round: list[dict[str, dict[str, Any]]],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, tuple[float, float]]]]:
    """The ratios of each round (recompute's from the round it ran in), their medians and ranges."""
    recompute = next(figs["recompute"] for figs in per_round if "recompute" in figs)
    tables = [ratios({"recompute": recompute, **figs}) for figs in per_round]
    medians: dict[str, dict[str, float]] = {}
    ranges: dict[str, dict[str, tuple[float, float]]] = {}
    pairs = {pair: None for table in tables for pair in table}
    for pair in pairs:
        keys = {key: None for table in tables for key in table.get(pair, {})}
        for key in keys:
            values = [table[pair][key] for table in tables if key in table.get(pair, {})]
            medians.setdefault(pair, {})[key] = statistics.median(values)
            ranges.setdefault(pair, {})[key] = (min(values), max(values))
    return medians, ranges
