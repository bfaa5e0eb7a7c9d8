"""Smoke test of ``python -m benchmarks vllm`` at a tiny size, on real vLLM engines and a real Mooncake.

Timings are not checked (the machine is shared); what is checked: every configuration ran, the loading
engine really got its prompt's blocks from the store, the greedy tokens agree everywhere, and the
output comparison catches a single wrong token.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import vllm as bench
from benchmarks.vllm_figures import (
    check_outputs,
    format_table,
    output_mismatches,
    reference_boundaries,
    step_inflation,
    summarize,
)

from .mooncake_support import in_ci, require_mooncake

PROMPT_TOKENS = 1000  # 7 full blocks and 104 tokens: a prompt's last partial block matters
OUTPUT_TOKENS = 4
TINY = [
    "--prompt-tokens", str(PROMPT_TOKENS), "--repeats", "1", "--store-repeats", "2",
    "--output-tokens", str(OUTPUT_TOKENS),
    "--probe-tokens", "512", "--probe-steps", "4", "--prefixes", "2", "--per-prefix", "4",
    "--prefix-tokens", "1024", "--suffix-tokens", "128", "--layers", "2", "--kv-cache-gib", "1",
]  # fmt: skip


def require_engine() -> None:
    """Skip (fail under CI) unless vLLM, Mooncake, a private namespace and AiokvConnector are here."""
    require_mooncake()
    reasons = []
    if importlib.util.find_spec("vllm") is None:
        reasons.append("vLLM is not installed (pip install 'aiokv[vllm]')")
    missing = bench.aiokv_available()
    if missing is not None:
        reasons.append(f"AiokvConnector is not importable: {missing}")
    if not reasons:
        return
    if in_ci():
        pytest.fail("CI must run the vLLM benchmark, but: " + "; ".join(reasons), pytrace=False)
    pytest.skip("; ".join(reasons))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_engine()
    out = tmp_path_factory.mktemp("bench-vllm") / "figures.json"
    rc = bench.main([*TINY, "--no-unshare", "--json", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    result["rc"] = rc
    return result


@pytest.mark.mooncake
def test_every_configuration_runs_and_outputs_agree(tiny_run: dict[str, Any]) -> None:
    assert tiny_run["configs"] == list(bench.CONFIGS)
    # Several concurrent requests per stored prefix: a connector mixing up their blocks gives wrong tokens.
    assert tiny_run["wrong_outputs"] == []
    assert tiny_run["diverged_outputs"] == []  # this 2-layer model's outputs have always been exact
    assert tiny_run["rc"] == 0
    (results,) = tiny_run["raw"]  # one round
    recompute_tokens = results["recompute"]["load"]["long"][0]["local"]["requests"][0]["tokens"]
    assert len(recompute_tokens) == OUTPUT_TOKENS
    # Every long-prompt load had a reference at its hit boundary, so all of them were compared.
    reference = results["recompute"]["load"]["long"][0]
    reference_runs = [*reference["external"], reference["local"], *reference["boundaries"].values()]
    boundaries = {run["requests"][0]["cached_tokens"] for run in reference_runs}
    for name in bench.CONFIGS:
        for run in results[name]["load"]["long"][0]["external"]:
            request = run["requests"][0]
            assert set(reference_boundaries(request, bench.BLOCK_SIZE)) <= boundaries | {0}, name
            assert len(request["tokens"]) == OUTPUT_TOKENS
    assert tiny_run["unverified_requests"]["recompute"] == 0


@pytest.mark.mooncake
def test_loading_engine_hits_the_store(tiny_run: dict[str, Any]) -> None:
    figures = tiny_run["figures"]
    key = f"hit_tokens:{PROMPT_TOKENS}"
    assert figures["recompute"][key] == 0
    # vLLM's connector: every full block. AiokvConnector: the prompt's last partial block too, so its
    # asynchronous load covers the whole prompt (vLLM then computes only its last token); with vLLM's
    # keys, or with that block not stored, every full block.
    full_blocks = PROMPT_TOKENS // 128 * 128
    assert 0 < figures["vllm"][key] <= full_blocks
    assert figures["aiokv"][key] == PROMPT_TOKENS
    assert figures["aiokv-vllm-keys"][key] == figures["aiokv-full-blocks"][key] == full_blocks
    for name in ("vllm", "aiokv", "aiokv-vllm-keys", "aiokv-full-blocks"):
        assert figures[name]["mixed_load_hit_tokens"] > 0, name
        # (load_gbps is left out when a hit was not slower than vLLM's own cache: timing, not checked)
        assert figures[name][f"ttft_s:{PROMPT_TOKENS}"] > 0, name
    assert set(tiny_run["ratios"]) == {
        "aiokv",
        "aiokv-vllm-keys",
        "aiokv-full-blocks",
        "aiokv/aiokv-unverified",
    }
    assert tiny_run["goals"], "the goals against vLLM's connector were not judged"


@pytest.mark.mooncake
def test_store_figures_are_medians_over_the_cold_prompts(tiny_run: dict[str, Any]) -> None:
    (results,) = tiny_run["raw"]
    for name in bench.CONFIGS:
        store = results[name]["store"]
        runs = [*store["long"], *store["cold"]]
        requests = [run["requests"][0] for run in runs]
        assert [r["prompt_tokens"] for r in requests] == [PROMPT_TOKENS] * 2, name
        assert requests[0]["name"] != requests[1]["name"], name  # its own tokens: cold too
        assert all(r["cached_tokens"] == 0 for r in requests), name
        ttfts = [r["ttft_s"] for r in requests]
        figures = tiny_run["per_round"][0][name]
        assert figures[f"store_ttft_s:{PROMPT_TOKENS}"] == pytest.approx(sum(ttfts) / 2), name
        assert figures[f"store_cpu_s:{PROMPT_TOKENS}"] == pytest.approx(sum(r["cpu_s"] for r in runs) / 2)
        in_connector = [run["step_connector_s"][run["requests"][0]["first_token_step"]] for run in runs]
        if name == "recompute":
            assert f"store_connector_ms:{PROMPT_TOKENS}" not in figures
        else:  # the connector's share of the prefill step that gave the first token
            assert figures[f"store_connector_ms:{PROMPT_TOKENS}"] == pytest.approx(500 * sum(in_connector))


@pytest.mark.mooncake
def test_every_engine_runs_with_the_malloc_tunables_and_times_each_step(
    tiny_run: dict[str, Any],
) -> None:
    (results,) = tiny_run["raw"]
    for name in bench.CONFIGS:
        for role in ("store", "load"):
            engine = results[name][role]
            wanted = set(bench.ENGINE_MALLOC_TUNABLES.split(":"))
            assert wanted <= set(engine["glibc_tunables"].split(":")), (name, role)
        for run in [*results[name]["store"]["long"], *results[name]["store"]["cold"]]:
            steps = len(run["step_seconds"])
            assert steps > 0
            assert len(run["step_cpu_s"]) == len(run["step_minor_faults"]) == len(run["step_gc_s"]) == steps
            assert len(run["step_connector_s"]) == steps
            in_connector = sum(run["step_connector_s"])
            # Every connector is timed (each step calls it), the run without one never is.
            assert (in_connector > 0) == (name != "recompute"), (name, in_connector)
            assert all(
                0 <= s <= step for s, step in zip(run["step_connector_s"], run["step_seconds"], strict=True)
            )
            gc_and_step = zip(run["step_gc_s"], run["step_seconds"], strict=True)
            assert all(0 <= gc_s <= step for gc_s, step in gc_and_step)
            assert all(faults >= 0 for faults in run["step_minor_faults"])
            prefill = run["requests"][0]["first_token_step"]
            assert run["step_cpu_s"][prefill] > 0, name  # the prefill computed in this process


def test_engine_env_adds_the_malloc_tunables_to_the_callers() -> None:
    tunables = "glibc.malloc.mmap_threshold=1"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX2")
        env = bench.engine_env(None, 1, tunables)
        assert env["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX2:" + tunables
        assert bench.engine_env(None, 1, "")["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX2"
        patch.delenv("GLIBC_TUNABLES")
        assert bench.engine_env(None, 1, tunables)["GLIBC_TUNABLES"] == tunables
        assert "GLIBC_TUNABLES" not in bench.engine_env(None, 1, "")


@pytest.mark.mooncake
def test_a_single_wrong_token_is_caught(tiny_run: dict[str, Any]) -> None:
    # On the reference and vLLM's own connector only, so that this control does not depend on the
    # configuration under test being right.
    full = tiny_run["raw"][0]
    results = copy.deepcopy({name: full[name] for name in ("recompute", "vllm")})
    assert output_mismatches(results, "recompute", bench.BLOCK_SIZE) == []
    request = results["vllm"]["load"]["long"][0]["external"][0]["requests"][0]
    request["tokens"][-1] = (request["tokens"][-1] + 1) % 1024
    problems = output_mismatches(results, "recompute", bench.BLOCK_SIZE)
    assert problems and all(problem.startswith("vllm:") for problem in problems)
    wrong, diverged, _ = check_outputs(results, "recompute", bench.BLOCK_SIZE)
    assert not wrong and diverged  # only the last token differs: it diverged late
    request["tokens"][0] = (request["tokens"][0] + 1) % 1024
    wrong, _, _ = check_outputs(results, "recompute", bench.BLOCK_SIZE)
    assert wrong and all(problem.startswith("vllm:") for problem in wrong)


def test_cli_refuses_configs_without_the_baseline(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--configs", "vllm", "--json", str(tmp_path / "x.json")])


def _probe(step_ms: list[float], in_flight: int) -> dict[str, Any]:
    """A probe run: the long prompt's prefill is step 0, then the short request's decode steps, the
    first ``in_flight`` of them with a store pending."""
    steps = [0.5, *(ms / 1000 for ms in step_ms)]
    pending = [1 if i < in_flight else 0 for i in range(len(steps))]
    requests = [{"finished_step": len(steps) - 1}, {"first_token_step": 0}]
    return {"store": {"probe": {"requests": requests, "step_seconds": steps, "pending_stores": pending}}}


def test_step_inflation_judges_every_configuration_on_the_same_steps() -> None:
    results = {
        "recompute": _probe([10, 10, 10, 10, 10, 10], 0),
        "quick": _probe([30, 20, 10, 10, 10, 10], 2),  # its store overlapped 2 steps
        "slow": _probe([16, 16, 16, 16, 10, 10], 4),
    }
    inflation = step_inflation(results)
    # Over the slowest store's 4 steps for everyone: quick (30+20+10+10)/40, slow 64/40.
    assert inflation == pytest.approx({"recompute": 1.0, "quick": 1.75, "slow": 1.6})
    assert step_inflation({name: _probe([10, 10], 0) for name in ("recompute", "x")}) == {
        "recompute": 1.0,
        "x": 1.0,
    }


def test_verification_cost_is_judged_against_the_same_connector_unverified() -> None:
    figures = {
        "recompute": {"load_cpu_s:2000": 3.0},
        "aiokv": {
            "load_cpu_s:2000": 1.04,
            "store_cpu_s:2000": 1.10,
            "ttft_s:2000": 0.5,
            "hit_tokens:2000": 1920,
        },
        "aiokv-unverified": {"load_cpu_s:2000": 1.0, "store_cpu_s:2000": 1.0, "ttft_s:2000": 0.5},
    }
    summary = summarize(figures)
    ratios = summary["ratios"]["aiokv/aiokv-unverified"]
    assert ratios == pytest.approx({"load_cpu_s:2000": 1.04, "store_cpu_s:2000": 1.10, "ttft_s:2000": 1.0})
    assert summary["goals"] == {
        "load_cpu_s:2000 <= 1.05x unverified": True,
        "store_cpu_s:2000 <= 1.05x unverified": False,
        "ttft_s:2000 <= 1.05x unverified": True,
    }
    assert "aiokv/aiokv-unverified" in format_table(summary).splitlines()[0]
    config = bench.kv_transfer_config("aiokv-unverified", {"master_server_address": "x"})
    assert config is not None and config["kv_connector_extra_config"]["verify_values"] is False
