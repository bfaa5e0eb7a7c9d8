"""Figures, output checks and goals for ``python -m aiokv bench vllm``, from the engines' JSON results.

Every figure comes from the engine processes' own clocks (``vllm_engine``); this module only reduces
them. Each configuration's result is ``{"store": <store engine JSON>, "load": <load engine JSON>}``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Figures where a smaller value is better; all others are better when larger.
LOWER_IS_BETTER = ("ttft", "cpu", "inflation", "drain")

GOAL_TTFT_HIT_RATIO = 0.8


@dataclass(frozen=True)
class Geometry:
    block_size: int
    block_bytes: int  # one block of every layer (K and V)


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _ttft(run: dict[str, Any], index: int = 0) -> float:
    value = run["requests"][index]["ttft_s"]
    if value is None:
        raise ValueError(f"request {run['requests'][index]['name']} produced no token")
    return float(value)


def _probe_inflation_steps(probe: dict[str, Any]) -> tuple[list[float], int]:
    """The short request's decode step times after the long prompt's prefill, and how many of them
    ran while the long prompt's stores were still in flight."""
    long_request, short_request = probe["requests"][1], probe["requests"][0]
    first = int(long_request["first_token_step"]) + 1
    last = int(short_request["finished_step"])
    steps = probe["step_seconds"][first : last + 1]
    pending = probe["pending_stores"][first - 1 : last]  # held before each step started
    in_flight = sum(1 for held in pending if held > 0)
    return steps, in_flight


def config_figures(result: dict[str, Any], geometry: Geometry) -> dict[str, float]:
    """One configuration's figures, keyed ``<figure>[:<size>]``."""
    store, load = result["store"], result["load"]
    figures: dict[str, float] = {}
    for stored, loaded in zip(store["long"], load["long"], strict=True):
        tokens = int(stored["requests"][0]["prompt_tokens"])
        hits = loaded["external"]
        ttft_hit = _median([_ttft(run) for run in hits])
        ttft_local = _ttft(loaded["local"])
        hit_tokens = min(int(run["requests"][0]["cached_tokens"]) for run in hits)
        figures[f"ttft_s:{tokens}"] = ttft_hit
        figures[f"ttft_local_s:{tokens}"] = ttft_local
        figures[f"hit_tokens:{tokens}"] = float(hit_tokens)
        figures[f"store_ttft_s:{tokens}"] = _ttft(stored)
        figures[f"load_cpu_s:{tokens}"] = _median([float(run["cpu_s"]) for run in hits])
        figures[f"store_cpu_s:{tokens}"] = float(stored["cpu_s"])
        if hit_tokens > 0 and ttft_hit > ttft_local:
            loaded_bytes = hit_tokens // geometry.block_size * geometry.block_bytes
            figures[f"load_gbps:{tokens}"] = loaded_bytes / (ttft_hit - ttft_local) / 1e9
        stored_bytes = tokens // geometry.block_size * geometry.block_bytes
        if float(stored["drain_s"]) > 0 and result.get("connector"):
            figures[f"store_gbps:{tokens}"] = stored_bytes / float(stored["drain_s"]) / 1e9
        figures[f"store_drain_s:{tokens}"] = float(stored["drain_s"])
    steps, in_flight = _probe_inflation_steps(store["probe"])
    figures["probe_step_ms"] = 1000 * statistics.fmean(steps)
    figures["probe_steps_in_flight"] = float(in_flight)
    for engine, run in (("store", store["mixed"]), ("load", load["mixed"])):
        requests = run["requests"]
        tokens_done = sum(int(r["prompt_tokens"]) + len(r["tokens"]) for r in requests)
        figures[f"mixed_{engine}_rps"] = len(requests) / float(run["outputs_s"])
        figures[f"mixed_{engine}_tps"] = tokens_done / float(run["outputs_s"])
        figures[f"mixed_{engine}_cpu_s"] = float(run["cpu_s"]) / len(requests)
        figures[f"mixed_{engine}_drain_s"] = float(run["drain_s"])
        figures[f"mixed_{engine}_hit_tokens"] = float(sum(int(r["cached_tokens"]) for r in requests))
    return figures


def step_inflation(results: dict[str, dict[str, Any]], baseline: str = "recompute") -> dict[str, float]:
    """Mean decode-step time while a configuration's stores were in flight, over the same steps of the
    run without a connector (1.0: no slowdown). Configurations whose stores finished within the
    prefill step get 1.0 (no step overlapped them)."""
    if baseline not in results:
        return {}
    base_steps, _ = _probe_inflation_steps(results[baseline]["store"]["probe"])
    inflation: dict[str, float] = {}
    for name, result in results.items():
        steps, in_flight = _probe_inflation_steps(result["store"]["probe"])
        count = min(in_flight, len(steps), len(base_steps))
        if count == 0:
            inflation[name] = 1.0
            continue
        inflation[name] = statistics.fmean(steps[:count]) / statistics.fmean(base_steps[:count])
    return inflation


def _outputs(result: dict[str, Any]) -> dict[str, list[int]]:
    """Every request's greedy tokens, keyed by engine, phase and request."""
    tokens: dict[str, list[int]] = {}

    def add(prefix: str, run: dict[str, Any]) -> None:
        for request in run["requests"]:
            tokens[f"{prefix}/{request['name']}"] = list(request["tokens"])

    store, load = result["store"], result["load"]
    for phase in ("warmup", "probe", "mixed"):
        add(f"store/{phase}", store[phase])
    add("load/warmup", load["warmup"])
    add("load/mixed", load["mixed"])
    for stored in store["long"]:
        add("store/long", stored)
    for loaded in load["long"]:
        for repeat, run in enumerate(loaded["external"]):
            add(f"load/long/external{repeat}", run)
        add("load/long/local", loaded["local"])
    return tokens


def output_mismatches(results: dict[str, dict[str, Any]], reference: str) -> list[str]:
    """Requests whose greedy tokens differ from ``reference``'s (or between a prompt's repeats)."""
    problems: list[str] = []
    expected = _outputs(results[reference])
    for name, result in results.items():
        got = _outputs(result)
        for key, tokens in expected.items():
            if got.get(key) != tokens:
                problems.append(f"{name}: {key} gave {got.get(key)} instead of {tokens}")
        for loaded in result["load"]["long"]:
            runs = [*loaded["external"], loaded["local"]]
            if len({tuple(run["requests"][0]["tokens"]) for run in runs}) != 1:
                problems.append(f"{name}: the repeats of {runs[0]['requests'][0]['name']} differ")
        if not all(r["tokens"] for r in result["load"]["mixed"]["requests"]):
            problems.append(f"{name}: a mixed-workload request produced no tokens")
    return problems


def better(figure: str) -> Callable[[float, float], bool]:
    """``better(figure)(a, b)``: a is at least as good as b."""
    if figure.split(":")[0].startswith(("ttft", "store_ttft")) or any(w in figure for w in LOWER_IS_BETTER):
        return lambda a, b: a <= b
    return lambda a, b: a >= b
