"""One vLLM engine for ``python -m benchmarks vllm``, run as its own process.

``python -m benchmarks.vllm_engine SPEC.json RESULT.json``: builds an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the parent, so scheduler and worker connector live here)
with the spec's KV connector, drives it step by step through ``LLMEngine.step`` and writes every
timing, the greedy tokens and the CPU seconds of this process as JSON.

Role ``store``: warm-up, long prompts cold (each waits until its stores are done, which the scheduler
shows by keeping the request until the connector reports the sending finished), the step probe (a
short request decoding while a long prompt's store runs) and the mixed workload. Role ``load``: the same
warm-up (a hit, so the load path is warm), each long prompt after clearing vLLM's own prefix cache (an
external hit), then once more without clearing (vLLM's own cache: only the last block computed), and the
mixed workload with new suffixes on the stored prefixes.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("benchmarks.vllm")

# A run that has not finished by then is stuck (a store that never completes, a load that never lands).
RUN_TIMEOUT_S = 600.0


@dataclass
class RequestRecord:
    name: str
    prompt_tokens: int
    added: float
    first_token: float | None = None
    first_token_step: int | None = None
    finished: float | None = None
    finished_step: int | None = None
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0


@dataclass
class RunRecord:
    """One batch of requests submitted together and stepped to completion."""

    requests: list[RequestRecord]
    step_starts: list[float]
    step_seconds: list[float]
    step_meters: dict[str, list[float]]  # per step, each of :class:`_StepMeters`' readings
    pending_stores: list[int]
    started: float
    outputs_done: float
    drained: float
    cpu_seconds: float

    def summary(self) -> dict[str, Any]:
        return {
            "requests": [
                {
                    "name": r.name,
                    "prompt_tokens": r.prompt_tokens,
                    "ttft_s": None if r.first_token is None else r.first_token - r.added,
                    "first_token_step": r.first_token_step,
                    "latency_s": None if r.finished is None else r.finished - r.added,
                    "finished_step": r.finished_step,
                    "tokens": r.tokens,
                    "cached_tokens": r.cached_tokens,
                }
                for r in self.requests
            ],
            "step_seconds": self.step_seconds,
            **self.step_meters,
            "pending_stores": self.pending_stores,
            "step_offsets_s": [start - self.started for start in self.step_starts],
            "outputs_s": self.outputs_done - self.started,
            # From the last output until the scheduler let go of every request: the stores' tail.
            "drain_s": self.drained - self.outputs_done,
            "cpu_s": self.cpu_seconds,
        }


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _GcClock:
    """Seconds this process has spent in the garbage collector since it was made (any thread)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


class _ConnectorClock:
    """Wall seconds this thread (the engine's) has spent inside the connectors' methods since it was
    made: both halves, scheduler and worker, of whichever connector the engine runs."""

    def __init__(self, connectors: list[Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        self.seconds = 0.0
        self._thread = threading.get_ident()
        self._depth = 0  # a method calling another of its own is counted once
        api = [name for name in dir(KVConnectorBase_V1) if not name.startswith("_")]
        for connector in connectors:
            for name in api:
                method = getattr(connector, name, None)
                if callable(method):
                    setattr(connector, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread or self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._depth -= 1

        return timed


class _StepMeters:
    """Cumulative readings of this process, taken before and after each step: the step's share."""

    def __init__(self, connectors: list[Any]) -> None:
        gc_clock, connector_clock = _GcClock(), _ConnectorClock(connectors)
        self._readers: dict[str, Callable[[], float]] = {
            "step_cpu_s": time.process_time,  # a slow step computing vs waiting
            "step_minor_faults": _minor_faults,  # pages first touched: fresh memory vs reused
            "step_gc_s": lambda: gc_clock.seconds,  # a stalled step collecting garbage vs not
            "step_connector_s": lambda: connector_clock.seconds,  # the connector's own share
        }

    def read(self) -> dict[str, float]:
        return {name: read() for name, read in self._readers.items()}


def _connectors(scheduler: Any) -> list[Any]:
    """The scheduler's connector and the worker's (in-process mode: both live in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    found = [scheduler.connector] if scheduler.connector is not None else []
    if has_kv_transfer_group():
        found.append(get_kv_transfer_group())
    return found


class EngineDriver:
    """Steps one ``LLM``'s engine by hand so that every step and every first token is timed."""

    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._llm = llm
        self._engine = llm.llm_engine
        # In-process mode: the engine core (and its scheduler) are objects of this process.
        self._scheduler = self._engine.engine_core.engine_core.scheduler
        self._sampling = SamplingParams
        self._prompt = TokensPrompt
        self._serial = 0
        self._meters = _StepMeters(_connectors(self._scheduler))

    def pending_stores(self) -> int:
        """Finished requests the scheduler still holds for the connector (their blocks are being stored),
        plus one while the connector says it holds blocks of its own for stores in flight (vLLM's
        Mooncake store connector takes block references instead of delaying the request's free)."""
        running, waiting = self._scheduler.get_request_counts()
        held = len(self._scheduler.requests) - running - waiting
        connector = self._scheduler.connector
        return held + int(connector is not None and bool(connector.has_pending_push_work()))

    def busy(self) -> bool:
        """Requests still running, or finished but held while the connector stores their blocks."""
        return bool(self._engine.has_unfinished_requests() or self._scheduler.has_requests())

    def run(self, prompts: list[dict[str, Any]], *, drain: bool = True) -> RunRecord:
        """Submit ``prompts`` (``name``, ``ids``, ``max_tokens``) at once and step until all are done,
        then (``drain``) until their stores are done too."""
        if self.busy():
            raise RuntimeError("the engine still holds requests from the last run")
        cpu_start = time.process_time()
        started = time.perf_counter()
        records: dict[str, RequestRecord] = {}
        for prompt in prompts:
            self._serial += 1
            request_id = f"{prompt['name']}#{self._serial}"
            params = self._sampling(
                temperature=0.0, max_tokens=int(prompt["max_tokens"]), detokenize=False, ignore_eos=True
            )
            records[request_id] = RequestRecord(prompt["name"], len(prompt["ids"]), time.perf_counter())
            self._engine.add_request(request_id, self._prompt(prompt_token_ids=list(prompt["ids"])), params)
        step_starts: list[float] = []
        step_seconds: list[float] = []
        step_meters: dict[str, list[float]] = {name: [] for name in self._meters.read()}
        pending_stores: list[int] = []
        outputs_done: float | None = None
        deadline = started + RUN_TIMEOUT_S
        while self.busy() if drain else self._engine.has_unfinished_requests():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"requests not done after {RUN_TIMEOUT_S:.0f} s: {sorted(records)}")
            step_start, before = time.perf_counter(), self._meters.read()
            outputs = self._engine.step()
            now = time.perf_counter()
            step_starts.append(step_start)
            step_seconds.append(now - step_start)
            for name, reading in self._meters.read().items():
                step_meters[name].append(reading - before[name])
            pending_stores.append(self.pending_stores())
            for output in outputs:
                record = records[output.request_id]
                completion = output.outputs[0] if output.outputs else None
                if record.first_token is None and completion is not None and completion.token_ids:
                    record.first_token = now
                    record.first_token_step = len(step_seconds) - 1
                    record.cached_tokens = int(output.num_cached_tokens or 0)
                if output.finished:
                    record.finished = now
                    record.finished_step = len(step_seconds) - 1
                    record.tokens = list(completion.token_ids) if completion is not None else []
            if outputs_done is None and all(r.finished is not None for r in records.values()):
                outputs_done = now
        end = time.perf_counter()
        return RunRecord(
            requests=list(records.values()),
            step_starts=step_starts,
            step_seconds=step_seconds,
            step_meters=step_meters,
            pending_stores=pending_stores,
            started=started,
            outputs_done=end if outputs_done is None else outputs_done,
            drained=end,
            cpu_seconds=time.process_time() - cpu_start,
        )

    def clear_prefix_cache(self) -> None:
        """Forget vLLM's own cached blocks, so the next prompt can only hit the external store."""
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")


def build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    from aiokv.integrations.vllm.common.amx import allow_amx_tiles

    allow_amx_tiles()  # the configurations without AiokvConnector too (see that module)

    kwargs: dict[str, Any] = {}
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        load_format="safetensors",
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        seed=0,
        **kwargs,
    )


def run_store_role(driver: EngineDriver, spec: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"warmup": driver.run([spec["warmup"]]).summary(), "long": []}
    for prompt in spec["long"]:
        logger.info("store: %s cold", prompt["name"])
        result["long"].append(driver.run([prompt]).summary())
    result["cold"] = [driver.run([prompt]).summary() for prompt in spec["cold"]]
    logger.info("store: step probe")
    result["probe"] = driver.run(spec["probe"]).summary()
    logger.info("store: mixed workload (%d requests)", len(spec["mixed"]))
    result["mixed"] = driver.run(spec["mixed"]).summary()
    return result


def run_load_role(driver: EngineDriver, spec: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"warmup": driver.run([spec["warmup"]]).summary(), "long": []}
    for prompt in spec["long"]:
        hits = []
        for repeat in range(spec["repeats"]):
            logger.info("load: %s, external (repeat %d)", prompt["name"], repeat + 1)
            driver.clear_prefix_cache()
            hits.append(driver.run([prompt]).summary())
        logger.info("load: %s, vLLM's own prefix cache", prompt["name"])
        local = driver.run([prompt]).summary()
        # References at other hit boundaries: the prompt's first B tokens computed and cached by vLLM
        # itself, then the whole prompt. A hit's outputs are compared with these: vLLM's numerics (bf16,
        # the CPU attention kernels) differ slightly between computing a prompt whole and computing it
        # on top of cached blocks, enough to change greedy tokens of a random model now and then.
        boundaries: dict[str, Any] = {}
        for boundary in spec.get("boundaries", {}).get(prompt["name"], []):
            logger.info("load: %s, vLLM's own prefix cache holding %d tokens", prompt["name"], boundary)
            driver.clear_prefix_cache()
            head = {"name": f"{prompt['name']}-head", "ids": prompt["ids"][:boundary], "max_tokens": 1}
            driver.run([head])
            boundaries[str(boundary)] = driver.run([prompt]).summary()
        result["long"].append({"external": hits, "local": local, "boundaries": boundaries})
    driver.clear_prefix_cache()
    logger.info("load: mixed workload (%d requests)", len(spec["mixed"]))
    result["mixed"] = driver.run(spec["mixed"]).summary()
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m benchmarks.vllm_engine SPEC.json RESULT.json\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    spec = json.loads(Path(args[0]).read_text())
    start = time.perf_counter()
    cpu_start = time.process_time()
    llm = build_llm(spec)
    result: dict[str, Any] = {
        "start_s": time.perf_counter() - start,
        "start_cpu_s": time.process_time() - cpu_start,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),  # the allocator it ran with
    }
    driver = EngineDriver(llm)
    role = run_store_role if spec["role"] == "store" else run_load_role
    result |= role(driver, spec)
    Path(args[1]).write_text(json.dumps(result))
    logging.shutdown()
    # Everything is measured and written: skip the engine's and Mooncake's slow teardown (a client's
    # close takes 1-2 s; the engines mount no segment, so nothing of the store is lost).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
