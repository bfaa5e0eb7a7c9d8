"""A hit's phases seen from outside a connector, the same way for any connector: subclasses that stamp
vLLM's calls into them (``time.monotonic()``, one JSON line per call, one file per process), and the
phase table built from those stamps.

The servers of ``python -m benchmarks vllm --http`` load ``TimedAiokvConnector`` and
``TimedMooncakeStoreConnector`` from this module (``kv_connector_module_path: "benchmarks.vllm_phases"``)
when ``AIOKV_BENCH_EVENTS`` names a folder. A stamp costs a clock read and a short write per call.

Per request that loaded a hit (seconds): ``lookup`` (first ask until the answer; ``asks``: how many),
``alloc`` (until vLLM allocated its blocks), ``dispatch`` (until the step's metadata was built: the
workers start the load with that step), ``load`` (until a worker reported it received in
``get_transfer_results``), ``notice`` (until the scheduler heard, ``update_connector_output``), ``resume``
(until a step scheduled the request's tail), ``tail`` (that step, until the next one was built).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

EVENTS_ENV = "AIOKV_BENCH_EVENTS"
PHASES = ("lookup", "alloc", "dispatch", "load", "notice", "resume", "tail")


class _Stamps:
    """This process's stamp file (opened on first use: vLLM builds connectors in each process)."""

    def __init__(self) -> None:
        self._file: Any = None

    def write(self, event: str, ids: Iterable[str] = (), value: float | None = None) -> None:
        folder = os.environ.get(EVENTS_ENV)
        if not folder:
            return
        if self._file is None:
            self._file = open(Path(folder) / f"events.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        self._file.write(json.dumps([time.monotonic(), event, list(ids), value]) + "\n")


_stamps = _Stamps()


def _timed(base: type) -> type:
    """``base`` with vLLM's calls that bound a hit's phases stamped."""

    class Timed(base):  # type: ignore[misc, valid-type]
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            _stamps.write("ask", [request.request_id])
            answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if answer[0] is not None:
                _stamps.write("answer", [request.request_id], float(answer[0]))
            return answer

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            _stamps.write("alloc", [request.request_id], float(num_external_tokens))

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = super().build_connector_meta(scheduler_output)
            _stamps.write("step", scheduler_output.num_scheduled_tokens or ())
            return meta

        def update_connector_output(self, connector_output: Any) -> None:
            super().update_connector_output(connector_output)
            _stamps.write("recv", connector_output.finished_recving or ())

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            results = super().get_transfer_results(finished_req_ids)
            if results.finished_recving:
                _stamps.write("worker_recv", results.finished_recving)
            return results

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed


def __getattr__(name: str) -> Any:
    """The timed connectors, built on first use (importing a connector imports vLLM)."""
    if name == "TimedAiokvConnector":
        from aiokv.integrations.vllm.connector import AiokvConnector

        return _timed(AiokvConnector)
    if name == "TimedMooncakeStoreConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
            MooncakeStoreConnector,
        )

        return _timed(MooncakeStoreConnector)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def timed(transfer: dict[str, Any] | None) -> dict[str, Any] | None:
    """``transfer`` (a KV transfer config) with its connector replaced by the timed subclass."""
    if transfer is None:
        return None
    return {
        **transfer,
        "kv_connector": f"Timed{transfer['kv_connector']}",
        "kv_connector_module_path": __name__,
    }


def read_events(folder: Path) -> list[tuple[float, str, list[str], float | None]]:
    events = []
    for path in sorted(folder.glob("events.*.jsonl")):
        for line in path.read_text().splitlines():
            with_value = json.loads(line)
            events.append((float(with_value[0]), str(with_value[1]), list(with_value[2]), with_value[3]))
    return sorted(events, key=lambda event: event[0])


def phases_by_request(
    events: list[tuple[float, str, list[str], float | None]],
) -> dict[str, dict[str, float]]:
    """Per request that loaded a hit: each phase's seconds (and ``asks``), from the stamps."""
    first_ask: dict[str, float] = {}
    asks: dict[str, int] = {}
    out: dict[str, dict[str, float]] = {}
    marks: dict[str, dict[str, float]] = {}
    for at, event, ids, value in events:
        if event == "ask":
            for req in ids:
                if req not in marks:
                    first_ask.setdefault(req, at)
                    asks[req] = asks.get(req, 0) + 1
        elif event == "answer":
            for req in ids:
                if req in first_ask and req not in marks:
                    marks[req] = {"asked": first_ask.pop(req), "answered": at, "asks": asks.pop(req, 1)}
        elif event == "alloc":
            for req in ids:
                mark = marks.get(req)
                if mark is not None and "alloc" not in mark:
                    if not value:  # no load: not a hit this table is about
                        del marks[req]
                    else:
                        mark["alloc"] = at
        elif event == "step":
            scheduled = set(ids)
            for req, mark in list(marks.items()):
                if "alloc" in mark and "dispatch" not in mark:
                    mark["dispatch"] = at
                elif "resume" in mark and "tail" not in mark:
                    mark["tail"] = at
                    out[req] = _durations(mark)
                    del marks[req]
                elif "notice" in mark and "resume" not in mark and req in scheduled:
                    mark["resume"] = at
        elif event == "worker_recv":
            for req in ids:
                mark = marks.get(req)
                if mark is not None and "dispatch" in mark:
                    mark.setdefault("load", at)  # the first rank to report it (TP ranks report alike)
        elif event == "recv":
            for req in ids:
                mark = marks.get(req)
                if mark is not None and "load" in mark:
                    mark.setdefault("notice", at)
    return out


def _durations(mark: dict[str, float]) -> dict[str, float]:
    order = ["asked", "answered", "alloc", "dispatch", "load", "notice", "resume", "tail"]
    out = {phase: mark[order[i + 1]] - mark[order[i]] for i, phase in enumerate(PHASES)}
    return {**out, "asks": mark["asks"], "total": mark["tail"] - mark["asked"]}


def summary(by_request: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per phase: the median and mean over requests (milliseconds; ``asks`` as counted)."""
    out: dict[str, dict[str, float]] = {}
    for phase in (*PHASES, "total", "asks"):
        values = [figures[phase] for figures in by_request.values()]
        if not values:
            continue
        scale = 1.0 if phase == "asks" else 1e3
        out[phase] = {"p50": statistics.median(values) * scale, "mean": statistics.fmean(values) * scale}
    return {**out, "requests": {"p50": float(len(by_request)), "mean": float(len(by_request))}}


def inside_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """aiokv's own figures over a run, from its Prometheus samples before and after: the mean of each
    worker phase of a load (ms per batch; ``queue`` per request), and the CPU ms spent verifying
    values read, per load request."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {}
    for phase in ("queue", "prepare", "transfer", "settle"):
        count = delta(f"vllm:aiokv_load_{phase}_count_total")
        if count > 0:
            out[f"load {phase} (ms)"] = 1e3 * delta(f"vllm:aiokv_load_{phase}_seconds_total") / count
    loads = delta("vllm:aiokv_load_requests_total")
    if loads > 0:
        out["verify CPU per load (ms)"] = 1e3 * delta("vllm:aiokv_verify_read_seconds_total") / loads
    for phase in ("lookup", "load", "notice"):
        count = delta(f"vllm:aiokv_hit_{phase}_seconds_count")
        if count > 0:
            out[f"hit {phase}, own histogram (ms)"] = (
                1e3 * delta(f"vllm:aiokv_hit_{phase}_seconds_sum") / count
            )
    return out


def format_phase_table(phases: dict[str, dict[str, dict[str, float]]]) -> str:
    """Per configuration with stamps, each phase's median (mean) in ms."""
    names = [name for name, table in phases.items() if table]
    if not names:
        return ""
    lines = [f"{'hit phase, ms: p50 (mean)':28}" + "".join(f"{name:>20}" for name in names)]
    for phase in (*PHASES, "total", "asks", "requests"):
        cells = []
        for name in names:
            figures = phases[name].get(phase)
            cells.append("-" if figures is None else f"{figures['p50']:.1f} ({figures['mean']:.1f})")
        lines.append(f"{phase:28}" + "".join(f"{cell:>20}" for cell in cells))
    return "\n".join(lines) + "\n"
