"""``python -m benchmarks vllm-throttle``: time to first token of a hit while the link to the store slows
down, for AiokvConnector (which declines hits that load slower than a recompute, docs/vllm.md), the
same without that policy, vLLM's MooncakeStoreConnector, and a recompute, in one run.

A two-node world in network namespaces (:mod:`aiokv.testing.cluster`): node 0 holds the Mooncake segment,
node 1 runs the engines (pure clients, so every loaded byte crosses the link). The link into node 1 is
throttled by a ``tbf`` qdisc on its bridge port, at each ``--rates`` in turn (``full``: none). Every
engine first computes and stores the prompts at full speed; then, per rate, each engine asks each
prompt once with vLLM's prefix cache cleared (a recompute engine computes it; the others hit the store),
each prompt's requests back to back across the engines, in a turning order.
Greedy tokens must equal the recompute's. Run as root or inside ``unshare -rn``:
``unshare -rn sh -c 'ip link set lo up && exec python -m benchmarks vllm-throttle'``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from .report import finish_suite
from .vllm import engine_env
from .vllm_setup import kv_transfer_config
from .vllm_tier import EngineProcess
from .vllm_workload import BLOCK_SIZE, MODEL_SHAPE

CONFIGS = ("recompute", "aiokv", "aiokv-always", "vllm")
LOADER = 1  # the node the engines run on; node 0 holds the store's segment
GOAL = 1.1  # AiokvConnector's TTFT <= GOAL x the better of recompute and the unthrottled hit


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks vllm-throttle", description=__doc__)
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length (default 2,000)")
    parser.add_argument("--prompts", type=int, default=5, help="distinct prompts, each asked once per rate")
    parser.add_argument(
        "--rates", default="full,1000,400,200,100", help="link rates in Mbit/s, fastest first ('full': none)"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--engine", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def _engine(spec_path: str) -> None:
    """One engine (its own process), driven over stdin/stdout as :class:`EngineProcess` expects: ``hit``
    a prompt with vLLM's prefix cache cleared, answered with its TTFT, greedy tokens with their logprobs
    and the two most likely tokens at each position (a near-tie shows there), and, for AiokvConnector,
    the load policy's counters so far."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from aiokv.integrations.vllm.common.amx import allow_amx_tiles

    from .vllm_engine import build_llm

    allow_amx_tiles()
    spec = json.loads(Path(spec_path).read_text())
    llm = build_llm(spec)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in-process engine: an object of this process
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=2, ignore_eos=True)

    def ask(request_id: str, ids: list[int]) -> dict[str, Any]:
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)
        added, first, done = time.perf_counter(), None, None
        while engine.has_unfinished_requests() or scheduler.has_requests():  # until its stores are done
            for output in engine.step():
                completion = output.outputs[0]
                if first is None and completion.token_ids:
                    first = time.perf_counter()
                if output.finished:
                    done = output
        if done is None or first is None:
            raise RuntimeError(f"{request_id} did not finish")
        completion = done.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = completion.logprobs or []
        return {
            "ttft_s": first - added,
            "cached_tokens": int(done.num_cached_tokens or 0),
            "tokens": tokens,
            "logprobs": [lp[t].logprob for lp, t in zip(logprobs, tokens, strict=False)],
            "top": [
                sorted(([int(k), v.logprob] for k, v in lp.items()), key=lambda kv: -kv[1])[:2]
                for lp in logprobs
            ],
        }

    ask("warmup", list(range(3, 3 + 3 * BLOCK_SIZE)))
    print("@@{}", flush=True)
    for serial, line in enumerate(sys.stdin):
        command = json.loads(line)
        if command["op"] == "quit":
            break
        n = command["prompt"]
        if not command.get("keep_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        cpu = time.process_time()
        # first_tokens: the prompt's first tokens only (the one-token-left control's prompt)
        answer = ask(f"p{n}#{serial}", spec["prompts"][n][: command.get("first_tokens")])
        answer["cpu_s"] = time.process_time() - cpu  # the engine's and aiokv's threads
        connector = scheduler.connector
        answer["policy"] = connector.stats().get("load_policy") if hasattr(connector, "stats") else None
        print("@@" + json.dumps(answer), flush=True)


def throttle(world: Any, mbit: int | None) -> None:
    """Limit the link into the loading node to ``mbit`` Mbit/s (None: full speed)."""
    switch, port = world.switch, f"p{LOADER}"
    with contextlib.suppress(OSError):  # no qdisc yet
        switch.check("tc", "qdisc", "del", "dev", port, "root")
    if mbit is not None:
        burst = max(64 << 10, mbit * 1_000_000 // 8 // 100)  # 10 ms worth: tbf's timer needs room
        rate = ["rate", f"{mbit}mbit", "burst", str(burst), "latency", "500ms"]
        switch.check("tc", "qdisc", "add", "dev", port, "root", "tbf", *rate)


def _rates(text: str) -> list[int | None]:
    rates = [None if rate.strip() == "full" else int(rate) for rate in text.split(",") if rate.strip()]
    if not rates or any(rate is not None and rate <= 0 for rate in rates):
        raise ValueError(f"--rates must list positive Mbit/s or 'full', got {text!r}")
    return rates


@contextlib.contextmanager
def _world(segment_bytes: int) -> Iterator[Any]:
    from aiokv.testing.cluster import Cluster

    with Cluster(2) as cluster:
        cluster.node(0, segment_size=segment_bytes)  # holds the values; its worker is not used
        yield cluster.world


def run(
    *, tokens: int, prompts: int, rates: Sequence[int | None], configs: Sequence[str], seed: int = 0
) -> dict[str, Any]:
    """The whole measurement (the caller is in a namespace world's rights); the report."""
    from aiokv.testing.tiny_model import write_tiny_llama

    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or "recompute" not in configs:
        raise ValueError(f"--configs must name recompute and any of {', '.join(CONFIGS)}; got {unknown}")
    rng = random.Random(seed)
    ids = [[rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(tokens)] for _ in range(prompts)]
    layers, heads, head_dim = MODEL_SHAPE["num_layers"], MODEL_SHAPE["num_kv_heads"], MODEL_SHAPE["head_dim"]
    kv_bytes_per_token = 2 * layers * heads * head_dim * 2  # K and V, bf16
    stored = kv_bytes_per_token * tokens * prompts
    report: dict[str, Any] = {
        "tokens": tokens,
        "prompts": prompts,
        "kv_bytes_per_token": kv_bytes_per_token,
        "hit_bytes": kv_bytes_per_token * (tokens // BLOCK_SIZE) * BLOCK_SIZE,
        "rates_mbit": [rate or "full" for rate in rates],
        "configs": {},
    }
    segment = 2 * stored + (256 << 20)  # the values of two key formats
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-throttle-") as tmp, _world(segment) as world:
        workdir = Path(tmp)
        model = write_tiny_llama(workdir / "model", **MODEL_SHAPE, seed=seed)
        address = world.node_address(LOADER)
        store_config = {
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": world.master.address,
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": "64MB",
            "local_hostname": address,
        }
        config_path = workdir / "mooncake.json"
        config_path.write_text(json.dumps(store_config))
        env = engine_env(config_path, 1)
        env |= {"VLLM_HOST_IP": address, "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": address}
        engines: dict[str, EngineProcess] = {}
        try:
            for name in configs:
                base = "aiokv" if name.startswith("aiokv") else name
                extra = {"decline_slow_loads": name != "aiokv-always"} if base == "aiokv" else None
                spec = {
                    "model": str(model),
                    "max_model_len": tokens + 64,
                    "max_tokens": 8,
                    "prompts": ids,
                    "kv_transfer_config": kv_transfer_config(base, store_config, extra),
                }
                spec_path = workdir / f"{name}.spec.json"
                spec_path.write_text(json.dumps(spec))
                started = time.perf_counter()
                engines[name] = EngineProcess(
                    spec_path, env, workdir / f"{name}.log", module=__name__, popen=world.nodes[LOADER].popen
                )
                # Computed (and stored) once at full speed: the reference tokens and the values.
                first = [engines[name].ask(op="hit", prompt=n) for n in range(prompts)]
                report["configs"][name] = {"stored": first, "rates": []}
                if name == "recompute":  # vLLM's own prefix cache hits: the numerics' control pairs
                    report["configs"][name]["prefix_hits"] = [
                        engines[name].ask(op="hit", prompt=n, keep_cache=True) for n in range(prompts)
                    ]
                    # A whole-prompt hit leaves one token to compute: on AMX CPUs another kernel path
                    # than a prefill's, so the control is vLLM's prefix cache leaving one token too.
                    one_left = (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE + 1
                    report["configs"][name]["one_token_left"] = [
                        [
                            engines[name].ask(op="hit", prompt=n, first_tokens=one_left, keep_cache=keep)
                            for keep in (False, True)
                        ]
                        for n in range(prompts)
                    ]
                print(f"{name}: started and stored in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            names = list(engines)
            for rate in rates:
                throttle(world, rate)
                by_name: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
                for n in range(prompts):
                    # Each prompt's requests back to back, the order turning: a burst of load from
                    # other processes on a shared machine falls on every configuration alike.
                    for name in names[n % len(names) :] + names[: n % len(names)]:
                        by_name[name].append(engines[name].ask(op="hit", prompt=n))
                for name, hits in by_name.items():
                    report["configs"][name]["rates"].append(hits)
                    print(f"{name} at {rate or 'full'} Mbit/s: {_median(hits):.3f} s", file=sys.stderr)
        finally:
            throttle(world, None)
            for engine in engines.values():
                engine.close()
    return summarize(report)


def _median(hits: list[dict[str, Any]]) -> float:
    return statistics.median(hit["ttft_s"] for hit in hits)


def _declined(hits: list[dict[str, Any]], before: dict[str, Any] | None) -> dict[str, int]:
    """The load policy's counters moved over ``hits`` (from the counters before the first)."""
    last = hits[-1].get("policy") or {}
    start = before or {}
    return {
        key: int(value) - int(start.get(key, 0))
        for key, value in last.items()
        if key != "estimates" and int(value) - int(start.get(key, 0))
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per configuration and rate: the TTFT median, first and all, cached tokens, the policy's counters;
    the prompts whose tokens differ from the recompute's, every output (for a tolerance check) and the
    goal's ratios."""
    reference = [hit["tokens"] for hit in report["configs"]["recompute"]["stored"]]
    out_reference = [
        {k: hit[k] for k in ("tokens", "logprobs", "top")} for hit in report["configs"]["recompute"]["stored"]
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    for name, runs in report["configs"].items():
        before = runs["stored"][-1].get("policy")
        rows[name] = []
        for rate, hits in zip(report["rates_mbit"], runs["rates"], strict=True):
            rows[name].append(
                {
                    # Greedy tokens unequal to the recompute's (a near-tie may flip one on CPUs
                    # without AMX: the outputs are kept, for assert_same_greedy's check).
                    "differ": [n for n, hit in enumerate(hits) if hit["tokens"] != reference[n]],
                    "outputs": [{k: hit[k] for k in ("tokens", "logprobs", "top")} for hit in hits],
                    "rate_mbit": rate,
                    "ttft_s_median": _median(hits),
                    "ttft_s": [round(hit["ttft_s"], 4) for hit in hits],
                    "cpu_s_median": statistics.median(hit["cpu_s"] for hit in hits),
                    "cached_tokens": [hit["cached_tokens"] for hit in hits],
                    "policy": _declined(hits, before),
                    "estimates": (hits[-1].get("policy") or {}).get("estimates"),
                }
            )
            before = hits[-1].get("policy")
    out = {key: value for key, value in report.items() if key != "configs"}
    out["rows"] = rows
    out["reference"] = out_reference

    def outputs(hits: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: hit[k] for k in ("tokens", "logprobs", "top", "cached_tokens")} for hit in hits]

    # each engine's first pass (computed, and stored where it has a store)
    out["stored"] = {name: outputs(runs["stored"]) for name, runs in report["configs"].items()}
    out["prefix_hits"] = outputs(report["configs"]["recompute"]["prefix_hits"])
    out["one_token_left"] = [outputs(pair) for pair in report["configs"]["recompute"]["one_token_left"]]
    recompute = [row["ttft_s_median"] for row in rows["recompute"]]
    best_recompute = statistics.median(recompute)
    out["recompute_ttft_s_median"] = best_recompute
    kv_speed = report["hit_bytes"] / best_recompute
    out["prefill_equivalent_mbit"] = round(kv_speed * 8 / 1e6)  # the link speed where loading ties
    if "aiokv" in rows:
        unthrottled = rows["aiokv"][0]["ttft_s_median"]
        out["goal"] = [
            {
                "rate_mbit": row["rate_mbit"],
                "aiokv_over_best": row["ttft_s_median"] / min(base, unthrottled),
                **{
                    f"{name}_over_recompute": rows[name][i]["ttft_s_median"] / base
                    for name in ("aiokv", "aiokv-always", "vllm")
                    if name in rows
                },
            }
            for i, (row, base) in enumerate(zip(rows["aiokv"], recompute, strict=True))
        ]
        out["goal_met"] = all(entry["aiokv_over_best"] <= GOAL for entry in out["goal"])
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"TTFT across link rates ({report['tokens']} tokens, {report['hit_bytes'] / 1e6:.1f} MB of KV per "
        "hit; "
        f"recompute {report['recompute_ttft_s_median'] * 1e3:.0f} ms = loading at "
        f"{report['prefill_equivalent_mbit']} Mbit/s)",
        f"{'Mbit/s':>7} " + " ".join(f"{name:>14}" for name in report["rows"]) + "   aiokv/best  declined",
    ]
    for i, rate in enumerate(report["rates_mbit"]):
        cells = " ".join(f"{rows[i]['ttft_s_median'] * 1e3:>11.0f} ms" for rows in report["rows"].values())
        goal = report.get("goal", [])
        ratio = f"{goal[i]['aiokv_over_best']:>10.2f}" if goal else ""
        declined = report["rows"].get("aiokv", [{}] * (i + 1))[i].get("policy", {})
        lines.append(f"{rate!s:>7} {cells}   {ratio}  {declined.get('declined_requests', 0)} req")
    for name, rows in report["rows"].items():
        differ = {row["rate_mbit"]: row["differ"] for row in rows if row["differ"]}
        if differ:
            lines.append(f"{name}: greedy tokens differ from the recompute's (prompts per rate): {differ}")
    if "goal_met" in report:
        goal_text = f"aiokv <= {GOAL}x the better of recompute and the unthrottled hit"
        lines.append(f"goal ({goal_text}): {report['goal_met']}")
    return "\n".join(lines)


def _print_report(report: dict[str, Any], out: TextIO) -> None:
    out.write(format_report(report) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.engine:
        _engine(args.engine)
        return 0
    from aiokv.testing.cluster import world_unavailable_reason

    reason = world_unavailable_reason()
    if reason is not None:
        print(f"benchmarks.vllm_throttle cannot run here: {reason}", file=sys.stderr)
        return 2

    def make_report() -> dict[str, Any]:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        rates = _rates(args.rates)
        return run(tokens=args.tokens, prompts=args.prompts, rates=rates, configs=configs, seed=args.seed)

    return finish_suite("vllm-throttle", make_report, _print_report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
