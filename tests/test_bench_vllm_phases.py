"""``bench vllm --http``'s phase table from made-up stamps (benchmarks/vllm_phases.py): each phase from
the calls that bound it, requests without a load left out, aiokv's own figures from two scrapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.vllm_phases import (
    EVENTS_ENV,
    _stamps,
    inside_view,
    phases_by_request,
    read_events,
    summary,
    timed,
)


def test_each_phase_comes_from_the_calls_that_bound_it() -> None:
    events = [
        (10.0, "ask", ["r"], None),
        (10.1, "ask", ["r"], None),
        (10.2, "answer", ["r"], 256.0),
        (10.3, "alloc", ["r"], 256.0),
        (10.4, "step", [], None),  # the load leaves with this step
        (10.9, "worker_recv", ["r"], None),
        (11.0, "recv", ["r"], None),
        (11.1, "step", ["other"], None),  # the tail is not scheduled yet
        (11.3, "step", ["r"], None),  # the tail's step
        (11.8, "step", ["r"], None),
        (12.0, "ask", ["miss"], None),
        (12.1, "answer", ["miss"], 0.0),
        (12.2, "alloc", ["miss"], 0.0),  # no load: not in the table
    ]
    phases = phases_by_request(events)
    assert list(phases) == ["r"]
    got = {key: round(value, 6) for key, value in phases["r"].items()}
    assert got == {
        "lookup": 0.2,
        "alloc": 0.1,
        "dispatch": 0.1,
        "load": 0.5,
        "notice": 0.1,
        "resume": 0.3,
        "tail": 0.5,
        "asks": 2,
        "total": 1.8,
    }
    table = summary(phases)
    assert table["load"] == {"p50": pytest.approx(500.0), "mean": pytest.approx(500.0)}
    assert table["asks"]["p50"] == 2 and table["requests"]["p50"] == 1


def test_a_request_that_never_finished_its_tail_is_left_out() -> None:
    events = [
        (0.0, "ask", ["r"], None),
        (0.1, "answer", ["r"], 128.0),
        (0.2, "alloc", ["r"], 128.0),
        (0.3, "step", [], None),
        (0.4, "worker_recv", ["r"], None),
    ]
    assert phases_by_request(events) == {}
    assert summary({}) == {"requests": {"p50": 0.0, "mean": 0.0}}


def test_stamps_go_to_one_file_per_process_and_read_back_in_time_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVENTS_ENV, str(tmp_path))
    monkeypatch.setattr(_stamps, "_file", None)
    _stamps.write("ask", ["a"])
    _stamps.write("answer", ["a"], 3.0)
    _stamps._file.close()
    monkeypatch.setattr(_stamps, "_file", None)
    events = read_events(tmp_path)
    assert [(event, ids, value) for _, event, ids, value in events] == [
        ("ask", ["a"], None),
        ("answer", ["a"], 3.0),
    ]
    assert events[0][0] <= events[1][0]


def test_the_timed_config_names_the_subclass_in_this_module() -> None:
    config = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    assert timed(config) == {
        "kv_connector": "TimedMooncakeStoreConnector",
        "kv_connector_module_path": "benchmarks.vllm_phases",
        "kv_role": "kv_both",
    }
    assert timed(None) is None


def test_aiokv_inside_figures_are_means_between_two_scrapes() -> None:
    before = {"vllm:aiokv_load_transfer_seconds_total": 1.0, "vllm:aiokv_load_transfer_count_total": 10.0}
    after = {
        "vllm:aiokv_load_transfer_seconds_total": 1.5,
        "vllm:aiokv_load_transfer_count_total": 15.0,
        "vllm:aiokv_load_requests_total": 5.0,
        "vllm:aiokv_verify_read_seconds_total": 0.01,
    }
    assert inside_view(before, after) == {
        "load transfer (ms)": pytest.approx(100.0),
        "verify CPU per load (ms)": pytest.approx(2.0),
    }
