"""``bench vllm --http``'s reductions (aiokv/bench/vllm_http.py) on made-up completions: percentiles,
hits per prefix size, ratios, and the greedy-token comparison with recompute."""

from __future__ import annotations

import argparse

import pytest

from aiokv.testing.vllm_server import Completion, prometheus_samples
from benchmarks.vllm_http import (
    CONFIGS,
    build_prompts,
    compare_tokens,
    connector_store,
    deferred,
    figures,
    format_table,
    median_figures,
    median_ratios,
    ratios,
    round_orders,
)


def completion(tokens: list[int], cached: int, prompt_tokens: int, ttft: float) -> Completion:
    return Completion(tokens, [], cached=cached, prompt_tokens=prompt_tokens, seconds=ttft + 1, ttft_s=ttft)


def run(completions: list[list[Completion]], wall: float = 10.0, cpu: float = 5.0) -> dict[str, object]:
    return {"wall_s": wall, "server_cpu_s": cpu, "completions": completions}


def test_prompts_share_prefixes_in_turn_with_suffixes_of_their_own() -> None:
    args = argparse.Namespace(seed=0, prompt_tokens="200,300", suffix_tokens=7, clients=2, requests=3)
    prefixes, clients = build_prompts(args)
    assert sorted(prefixes) == [200, 300]
    assert [[len(p) for p in client] for client in clients] == [[207, 307, 207], [307, 207, 307]]
    assert clients[0][0][:200] == prefixes[200] and clients[1][0][:300] == prefixes[300]
    assert clients[0][0][200:] != clients[0][2][200:]  # each request's suffix is its own


def test_figures_and_ratios() -> None:
    slow = run([[completion([1], 0, 207, 4.0), completion([1], 0, 307, 6.0)]], wall=20.0, cpu=10.0)
    fast = run([[completion([1], 128, 207, 1.0), completion([1], 256, 307, 3.0)]], wall=10.0, cpu=5.0)
    want = figures(slow, [200, 300], 7)
    got = figures(fast, [200, 300], 7)
    assert got["hit_tokens"] == 384 and got["hit_tokens_by_prefix"] == {"200": [128], "300": [256]}
    assert got["ttft_p50_s"] == pytest.approx(2.0) and got["ttft_p99_s"] == pytest.approx(3.0)
    assert got["requests_per_s"] == pytest.approx(0.2) and got["server_cpu_s_per_request"] == 2.5
    table = ratios({"recompute": want, "aiokv": got})
    assert table["aiokv / recompute"]["ttft_p50_s"] == pytest.approx(0.4)
    assert table["aiokv / recompute"]["requests_per_s"] == pytest.approx(2.0)
    assert set(table) == {"aiokv / recompute"}  # no pair names a configuration that did not run
    tiered = ratios({"recompute": want, "aiokv": want, "tiered": got})
    assert tiered["tiered / aiokv"]["ttft_p50_s"] == pytest.approx(0.4)


def test_host_tier_configurations_load_from_the_storing_server() -> None:
    store = {"mode": "standalone-store"}
    for name, backend in (("embedded", "memory"), ("tiered", "tiered")):
        config = CONFIGS[name]
        transfer = config.transfer(store, {"chunk_blocks": 1})
        assert transfer is not None and not config.fresh_loader
        extra = transfer["kv_connector_extra_config"]
        assert extra["backend"] == backend and extra["chunk_blocks"] == 1
        assert ("mooncake_config" in extra) == (backend == "tiered")


def test_aiokv_attaches_to_the_client_service_and_aiokv_tcp_and_vllm_do_not() -> None:
    store = {"mode": "standalone-store", "global_segment_size": 0}
    attached = {**store, "client_service": "127.0.0.1:5"}
    configs = {name: connector_store(CONFIGS[name], store, "127.0.0.1:5") for name in CONFIGS}
    assert configs["aiokv"] == configs["unverified"] == configs["tiered"] == attached
    assert configs["aiokv-tcp"] == configs["vllm"] == store
    ours = CONFIGS["aiokv"].transfer(configs["aiokv"], {})
    over_tcp = CONFIGS["aiokv-tcp"].transfer(configs["aiokv-tcp"], {})
    assert ours is not None and over_tcp is not None
    assert ours["kv_connector_extra_config"]["mooncake_config"].pop("client_service") == "127.0.0.1:5"
    assert ours == over_tcp  # the transport aside, the same configuration


def test_unverified_differs_from_aiokv_only_by_unchecked_values() -> None:
    store = {"mode": "standalone-store"}
    checked = CONFIGS["aiokv"].transfer(store, {"chunk_blocks": 1})
    unchecked = CONFIGS["unverified"].transfer(store, {"chunk_blocks": 1})
    assert checked is not None and unchecked is not None
    assert unchecked["kv_connector_extra_config"].pop("verify_values") is False
    assert "verify_values" not in checked["kv_connector_extra_config"]  # the default: verified
    assert unchecked == checked


def test_greedy_tokens_compared_with_recompute() -> None:
    results = {
        "recompute": {"run": run([[completion([1, 2, 3], 0, 207, 1.0)]])},
        "aiokv": {"run": run([[completion([1, 9, 3], 128, 207, 1.0)]])},
    }
    again = {"aiokv": {"run": run([[completion([1, 2, 3], 128, 207, 1.0)]])}}
    table = compare_tokens([results, again])
    assert table["recompute"]["equal"] == 1
    assert table["aiokv"] == {
        "equal": 1,
        "different": 1,
        "examples": [{"round": 0, "client": 0, "request": 0, "position": 1, "hit": 128}],
    }


def test_rounds_alternate_the_order_and_run_recompute_once() -> None:
    orders = round_orders(["recompute", "vllm", "aiokv", "tiered"], 3)
    assert orders == [
        ["recompute", "vllm", "aiokv", "tiered"],
        ["tiered", "aiokv", "vllm"],
        ["vllm", "aiokv", "tiered"],
    ]


def test_rounds_give_median_figures_and_median_ratios_with_their_range() -> None:
    sizes, suffix = [200], 7

    def figs(ttft: float, cached: int = 128) -> dict[str, object]:
        return figures(run([[completion([1], cached, 207, ttft)]]), sizes, suffix)

    rounds = [
        {"recompute": figs(10.0, 0), "vllm": figs(2.0), "aiokv": figs(1.0)},
        {"vllm": figs(2.0), "aiokv": figs(3.0, 256)},
        {"vllm": figs(4.0), "aiokv": figs(2.0)},
    ]
    merged = median_figures(rounds, ["recompute", "vllm", "aiokv"])
    assert merged["aiokv"]["ttft_p50_s"] == 2.0 and merged["aiokv"]["rounds"] == 3
    assert merged["aiokv"]["hit_tokens_by_prefix"] == {"200": [128, 256]}
    assert merged["recompute"]["rounds"] == 1 and merged["recompute"]["requests"] == 1
    medians, spans = median_ratios(rounds)
    # aiokv / vllm per round: 0.5, 1.5, 0.5; against recompute (round 0's): 0.1, 0.3, 0.2
    assert medians["aiokv / vllm"]["ttft_p50_s"] == pytest.approx(0.5)
    assert spans["aiokv / vllm"]["ttft_p50_s"] == pytest.approx((0.5, 1.5))
    assert medians["aiokv / recompute"]["ttft_p50_s"] == pytest.approx(0.2)
    # Two rounds: medians are means of two, hit tokens included.
    two = median_figures(rounds[:2], ["recompute", "vllm", "aiokv"])
    assert two["aiokv"]["hit_tokens"] == 192.0
    summary = {
        "figures": two,
        "tokens": {n: {"equal": 1} for n in two},
        "ratios": median_ratios(rounds[:2])[0],
    }
    table = format_table(summary)
    assert "aiokv / vllm: ttft_p50_s 1.00" in table and "192" in table


def test_the_connectors_counters_are_read_from_the_servers_metrics() -> None:
    text = "\n".join(
        [
            "# HELP vllm:aiokv_lookups_deferred_total Scheduler asks answered 'ask again'",
            "# TYPE vllm:aiokv_lookups_deferred_total counter",
            'vllm:aiokv_lookups_deferred_total{engine="0",model_name="model"} 7.0',
            'vllm:aiokv_lookups_deferred_total{engine="1",model_name="model"} 2.0',
            'vllm:aiokv_chunks_loaded_total{engine="0",model_name="model"} 484.0',
            'vllm:num_requests_running{engine="0",model_name="model"} 1.0',
        ]
    )
    samples = prometheus_samples(text, "vllm:aiokv_")
    assert samples == {"vllm:aiokv_lookups_deferred_total": 9.0, "vllm:aiokv_chunks_loaded_total": 484.0}
    assert deferred({"aiokv_counters": samples}) == {"lookups_deferred": 9.0}
    assert deferred({"aiokv_counters": {}}) == {}  # vLLM's connector, recompute: no such counters
