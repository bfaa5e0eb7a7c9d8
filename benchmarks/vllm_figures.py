"""Figures, output checks and goals for ``python -m benchmarks vllm``, from the engines' JSON results.

Every figure comes from the engine processes' own clocks (``vllm_engine``); this module only reduces
them. Each configuration's result is ``{"store": <store engine JSON>, "load": <load engine JSON>}``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GOAL_TTFT_HIT_RATIO = 0.8
# Verified values against the same connector without: load time and CPU, store CPU within 5 %.
VERIFY_RATIO = "aiokv/aiokv-unverified"
GOAL_VERIFY_RATIO = 1.05
VERIFY_GOAL_FIGURES = ("ttft_s", "hit_wait_s", "load_cpu_s", "store_cpu_s")


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


def _hit_wait(run: dict[str, Any]) -> float:
    """From submitting the request to the start of the step that computes it: the lookup, the load
    and the polling until vLLM schedules the rest (the TTFT without the compute step)."""
    request = run["requests"][0]
    return _ttft(run) - float(run["step_seconds"][int(request["first_token_step"])])


def _prefill_in_connector(run: dict[str, Any]) -> float:
    """Seconds the engine's thread spent inside the connector in the step that computed the prompt:
    the connector's own share of that TTFT (the rest is the engine's compute)."""
    return float(run["step_connector_s"][int(run["requests"][0]["first_token_step"])])


def config_figures(result: dict[str, Any], geometry: Geometry) -> dict[str, float]:
    """One configuration's figures, keyed ``<figure>[:<size>]``."""
    store, load = result["store"], result["load"]
    figures: dict[str, float] = {}
    cold_runs: dict[int, list[dict[str, Any]]] = {}  # by prompt size: the long prompt and its repeats
    for run in [*store["long"], *store["cold"]]:
        cold_runs.setdefault(int(run["requests"][0]["prompt_tokens"]), []).append(run)
    for stored, loaded in zip(store["long"], load["long"], strict=True):
        tokens = int(stored["requests"][0]["prompt_tokens"])
        stores = cold_runs[tokens]
        hits = loaded["external"]
        ttft_hit = _median([_ttft(run) for run in hits])
        ttft_local = _ttft(loaded["local"])
        hit_tokens = min(int(run["requests"][0]["cached_tokens"]) for run in hits)
        figures[f"ttft_s:{tokens}"] = ttft_hit
        figures[f"ttft_local_s:{tokens}"] = ttft_local
        figures[f"hit_tokens:{tokens}"] = float(hit_tokens)
        figures[f"store_ttft_s:{tokens}"] = _median([_ttft(run) for run in stores])
        if result.get("connector") and all("step_connector_s" in run for run in stores):
            in_connector = _median([_prefill_in_connector(run) for run in stores])
            figures[f"store_connector_ms:{tokens}"] = 1000 * in_connector
        figures[f"load_cpu_s:{tokens}"] = _median([float(run["cpu_s"]) for run in hits])
        figures[f"store_cpu_s:{tokens}"] = _median([float(run["cpu_s"]) for run in stores])
        if hit_tokens > 0:
            wait = _median([_hit_wait(run) for run in hits])
            figures[f"hit_wait_s:{tokens}"] = wait
            loaded_bytes = -(-hit_tokens // geometry.block_size) * geometry.block_bytes
            figures[f"load_gbps:{tokens}"] = loaded_bytes / wait / 1e9
        stored_bytes = tokens // geometry.block_size * geometry.block_bytes
        drain = _median([float(run["drain_s"]) for run in stores])
        if drain > 0 and result.get("connector"):
            figures[f"store_gbps:{tokens}"] = stored_bytes / drain / 1e9
        figures[f"store_drain_s:{tokens}"] = drain
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
    """Mean decode-step time while the stores were in flight, over the same steps of the run without
    a connector (1.0: no slowdown). Every configuration is judged on the same steps: as many as the
    slowest configuration's store overlapped (a store that ends sooner is not judged on its heaviest
    first steps alone). 1.0 for all when no store overlapped a step."""
    if baseline not in results:
        return {}
    base_steps, _ = _probe_inflation_steps(results[baseline]["store"]["probe"])
    probes = {name: _probe_inflation_steps(result["store"]["probe"]) for name, result in results.items()}
    window = max(in_flight for _, in_flight in probes.values())
    inflation: dict[str, float] = {}
    for name, (steps, _) in probes.items():
        count = min(window, len(steps), len(base_steps))
        if count == 0:
            inflation[name] = 1.0
            continue
        inflation[name] = statistics.fmean(steps[:count]) / statistics.fmean(base_steps[:count])
    return inflation


def reference_boundaries(request: dict[str, Any], block_size: int) -> tuple[int, ...]:
    """The hit boundaries whose references a request may equal: its own, except for a hit of the whole
    prompt (an asynchronous load may cover it; vLLM then computes only the last token), which no run
    without a connector reproduces (vLLM's own prefix cache always leaves the last block to compute).
    Its KV was computed whole by the storing engine and its last token alone, so it is compared with
    both neighbours: the prompt computed whole (0) and on its cached blocks but the last one
    (measured: either can be the one it equals bitwise, the tokens of the other differing later)."""
    cached, prompt = int(request["cached_tokens"]), int(request["prompt_tokens"])
    if cached >= prompt > 0:
        return (0, (prompt - 1) // block_size * block_size)
    return (cached,)


def _outputs(
    result: dict[str, Any], *, local: bool, block_size: int
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Every request's (phase/name, hit tokens, greedy tokens) in one configuration; ``local``: with the
    runs on vLLM's own prefix cache (only the reference's are comparable: elsewhere some of the
    cached blocks were loaded, and so computed along another path)."""
    records: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def add(prefix: str, run: dict[str, Any]) -> None:
        for request in run["requests"]:
            key = f"{prefix}/{request['name']}"
            records.append((key, reference_boundaries(request, block_size), tuple(request["tokens"])))

    store, load = result["store"], result["load"]
    for phase in ("warmup", "probe", "mixed"):
        add(f"store/{phase}", store[phase])
    add("load/warmup", load["warmup"])
    add("load/mixed", load["mixed"])
    for stored in store["long"]:
        add("store/long", stored)
    for loaded in load["long"]:
        runs = [*loaded["external"], *loaded.get("boundaries", {}).values()]
        for run in [*runs, loaded["local"]] if local else runs:
            add("load/long", run)
    return records


def _first_difference(tokens: tuple[int, ...], want: tuple[int, ...]) -> int:
    """The index of the first differing token (the shorter one's length where one extends the other)."""
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), min(len(tokens), len(want))
    )


def check_outputs(
    results: dict[str, dict[str, Any]], reference: str, block_size: int
) -> tuple[list[str], list[str], dict[str, int]]:
    """Compare every request's greedy tokens with the ``reference`` run (no connector) at the same hit
    boundary: vLLM computing a prompt whole and on top of cached blocks can differ in the last bits,
    which may flip a greedy token of a random model, so a request is compared with a reference that
    had the same number of tokens cached by vLLM itself.

    Returns the requests whose first token already differs or that produced nothing (wrong KV is the
    likely cause), those that diverge later (also what numerics of another batch composition can do),
    and per configuration how many requests had no reference at their boundary (left unverified)."""
    expected: dict[tuple[str, int], tuple[int, ...]] = {}
    wrong: list[str] = []
    diverged: list[str] = []
    for key, (cached, *_), tokens in _outputs(results[reference], local=True, block_size=block_size):
        if expected.setdefault((key, cached), tokens) != tokens:
            diverged.append(f"{reference}: {key} with {cached} cached tokens is not deterministic")
    unverified: dict[str, int] = {}
    for name, result in results.items():
        unverified[name] = 0
        for key, boundaries, tokens in _outputs(result, local=name == reference, block_size=block_size):
            wants = [(b, expected[(key, b)]) for b in boundaries if (key, b) in expected]
            if not wants:
                unverified[name] += 1
                continue
            if any(tokens == want for _, want in wants):
                continue
            # Against the reference it follows longest (the only one, but for whole-prompt hits).
            first, boundary, want = max((_first_difference(tokens, w), b, w) for b, w in wants)
            problem = f"{name}: {key} ({boundary} tokens hit) differs from token {first}: "
            problem += f"{list(tokens)} vs {list(want)}"
            (wrong if first == 0 else diverged).append(problem)
    return wrong, diverged, unverified


def output_mismatches(results: dict[str, dict[str, Any]], reference: str, block_size: int) -> list[str]:
    """Every request whose greedy tokens differ from the reference's at the same hit boundary."""
    wrong, diverged, _ = check_outputs(results, reference, block_size)
    return wrong + diverged


def hit_boundaries(results: dict[str, dict[str, Any]], block_size: int) -> dict[str, list[int]]:
    """Per long prompt, the hit sizes the connectors' loading engines saw other than vLLM's own
    (every full block but the last token's): the reference engine reproduces each one."""
    boundaries: dict[str, set[int]] = {}
    for result in results.values():
        for loaded in result["load"]["long"]:
            for run in loaded["external"]:
                request = run["requests"][0]
                (boundary, *others) = reference_boundaries(request, block_size)
                own = (int(request["prompt_tokens"]) - 1) // block_size * block_size
                if not others and boundary not in (0, own):
                    boundaries.setdefault(request["name"], set()).add(boundary)
    return {name: sorted(values) for name, values in boundaries.items()}


_LOWER_IS_BETTER = ("ttft_s", "ttft_local_s", "hit_wait_s", "store_ttft_s", "store_connector_ms",
                    "load_cpu_s", "store_cpu_s",
                    "store_drain_s", "probe_step_ms", "step_inflation", "mixed_store_cpu_s",
                    "mixed_load_cpu_s", "mixed_store_drain_s", "mixed_load_drain_s")  # fmt: skip
# The figures the goals are judged on (AiokvConnector at least as good as vLLM's connector).
GOAL_FIGURES = ("ttft_s", "load_gbps", "store_gbps", "store_ttft_s", "load_cpu_s", "store_cpu_s",
                "step_inflation", "mixed_store_rps", "mixed_store_tps", "mixed_load_rps", "mixed_load_tps",
                "mixed_store_cpu_s", "mixed_load_cpu_s")  # fmt: skip


def better(figure: str) -> Callable[[float, float], bool]:
    """``better(figure)(a, b)``: a is at least as good as b."""
    if figure.split(":")[0] in _LOWER_IS_BETTER:
        return lambda a, b: a <= b
    return lambda a, b: a >= b


def round_figures(results: dict[str, dict[str, Any]], geometry: Geometry) -> dict[str, dict[str, float]]:
    """Every configuration's figures from one round, step inflation included."""
    figures = {name: config_figures(result, geometry) for name, result in results.items()}
    for name, inflation in step_inflation(results).items():
        figures[name]["step_inflation"] = inflation
    return figures


def median_figures(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per configuration and figure, the median over the rounds that have it."""
    combined: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(name for figures in rounds for name in figures):
        keys = dict.fromkeys(key for figures in rounds for key in figures.get(name, {}))
        combined[name] = {
            key: _median([figures[name][key] for figures in rounds if key in figures.get(name, {})])
            for key in keys
        }
    return combined


def summarize(figures: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Ratios of the AiokvConnector configurations to vLLM's connector, and the goals judged."""
    ratios: dict[str, dict[str, float]] = {}
    goals: dict[str, bool] = {}
    if "vllm" in figures:
        for name in (n for n in ("aiokv", "aiokv-vllm-keys", "aiokv-full-blocks") if n in figures):
            ratios[name] = {
                key: value / figures["vllm"][key]
                for key, value in figures[name].items()
                if figures["vllm"].get(key) and not key.startswith(("hit_tokens", "probe_steps"))
            }
        if "aiokv" in figures:
            for key, value in figures["aiokv"].items():
                if key in figures["vllm"] and key.split(":")[0] in GOAL_FIGURES:
                    goals[key] = better(key)(value, figures["vllm"][key])
            for key, ratio in ratios["aiokv"].items():
                if key.startswith("ttft_s:"):
                    goals[f"{key} <= {GOAL_TTFT_HIT_RATIO}x vllm"] = ratio <= GOAL_TTFT_HIT_RATIO
    if "aiokv" in figures and "aiokv-unverified" in figures:
        # What verified values cost: the same connector with verification on against off.
        plain = figures["aiokv-unverified"]
        ratios[VERIFY_RATIO] = {
            key: value / plain[key]
            for key, value in figures["aiokv"].items()
            if plain.get(key) and not key.startswith(("hit_tokens", "probe_steps"))
        }
        for key, ratio in ratios[VERIFY_RATIO].items():
            if key.split(":")[0] in VERIFY_GOAL_FIGURES:
                goals[f"{key} <= {GOAL_VERIFY_RATIO}x unverified"] = ratio <= GOAL_VERIFY_RATIO
    return {"figures": figures, "ratios": ratios, "goals": goals}


def format_table(summary: dict[str, Any]) -> str:
    figures: dict[str, dict[str, float]] = summary["figures"]
    names = list(figures)
    keys = list(dict.fromkeys(key for values in figures.values() for key in values))
    ratio_names = list(summary["ratios"])
    header = ["figure", *names, *(n if "/" in n else f"{n}/vllm" for n in ratio_names)]
    rows = [header]
    for key in keys:
        row = [key]
        row += [f"{figures[n][key]:.4g}" if key in figures[n] else "-" for n in names]
        row += [f"{summary['ratios'][n].get(key, float('nan')):.3g}" for n in ratio_names]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    for goal, met in summary["goals"].items():
        against = "aiokv" if goal.endswith("unverified") else "aiokv vs vllm"  # verified values' cost
        lines.append(f"goal {against} {goal}: {'met' if met else 'NOT met'}")
    return "\n".join(lines) + "\n"
