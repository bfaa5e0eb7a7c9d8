"""Helpers for the tests that run a real vLLM engine (CPU build) with AiokvConnector.

Each engine runs in a subprocess of its own (``engine_job.py``), in-process engine mode, with a small
random-weight Llama the tests write themselves. Where vLLM is missing the tests skip, except under CI,
where they fail.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokv.backends.mooncake_master import segment_holder
from tests.mooncake_support import in_ci, require_mooncake

ROOT = Path(__file__).resolve().parents[2]
JOB_SCRIPT = Path(__file__).with_name("engine_job.py")
BLOCK = 128  # vLLM's CPU attention block size
JOB_TIMEOUT_S = 300


@functools.cache
def vllm_unavailable_reason() -> str | None:
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
        import vllm  # noqa: F401
    except Exception as exc:  # a broken vLLM install raises more than ImportError
        return f"vLLM is not usable here ({type(exc).__name__}: {exc}); pip install 'aiokv[vllm]'"
    return None


def require_vllm() -> None:
    reason = vllm_unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI must run the vLLM tests, but: {reason}", pytrace=False)
    pytest.skip(reason)


def tokens(seed: int, count: int) -> list[int]:
    """A deterministic prompt of ``count`` token ids (avoiding the first few special ids)."""
    return np.random.default_rng(seed).integers(3, 1000, count).tolist()


def connector(extra: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    config = {
        "kv_connector": "AiokvConnector",
        "kv_connector_module_path": "aiokv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    config.update(overrides)
    return config


def vllm_mooncake_connector() -> dict[str, Any]:
    """vLLM's own MooncakeStoreConnector (reads MOONCAKE_CONFIG_PATH)."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {},
    }


def run_vllm_connector_engine(
    world: dict[str, Any], name: str, steps: list[dict[str, Any]], engine: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An engine of ``world["model"]`` with vLLM's own MooncakeStoreConnector on the world's store
    (``engine``: more engine arguments)."""
    return run_engine(
        world["root"],
        name,
        model=world["model"],
        engine=engine,
        env={**MOONCAKE_ENV, "MOONCAKE_CONFIG_PATH": str(world["mooncake_config"])},
        kv_transfer_config=vllm_mooncake_connector(),
        steps=steps,
    )


def standalone_config(path: Path, master_address: str) -> Path:
    """A Mooncake JSON as vLLM users write it: engines are pure clients of a holder's segment."""
    path.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_address,
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": "64MB",
            }
        )
    )
    return path


MOONCAKE_ENV = {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"}


@contextlib.contextmanager
def store_world(root: Path, master_address: str) -> Iterator[dict[str, Any]]:
    """What the Mooncake engine tests share: a process holding the store's segment (the engines are
    pure clients, so the KV outlives the engine that wrote it) and the engines' Mooncake JSON."""
    require_vllm()
    require_mooncake()
    with segment_holder(master_address, graceful=False):
        yield {"root": root, "mooncake_config": standalone_config(root / "mooncake.json", master_address)}


def run_engine(
    tmp_path: Path,
    name: str,
    *,
    model: Path,
    steps: list[dict[str, Any]],
    kv_transfer_config: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = JOB_TIMEOUT_S,
) -> dict[str, Any]:
    """Run one engine in a fresh process; its results, or AssertionError with its log's tail."""
    job = {
        "model": str(model),
        "steps": steps,
        "kv_transfer_config": kv_transfer_config,
        "engine": engine or {},
        "env": env or {},
    }
    job_path, out_path, log_path = (tmp_path / f"{name}.{ext}" for ext in ("job.json", "out.json", "log"))
    job_path.write_text(json.dumps(job))
    process_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                [sys.executable, str(JOB_SCRIPT), str(job_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=process_env,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
    if rc != 0 or not out_path.exists():
        raise AssertionError(f"engine {name} {'timed out' if rc is None else f'exited {rc}'}:\n{tail}")
    results: dict[str, Any] = json.loads(out_path.read_text())
    results["log"] = log_path.read_text(errors="replace")
    return results


def key_logged_engine(
    world: dict[str, Any],
    name: str,
    steps: list[dict[str, Any]],
    *,
    backend: str = "tests.vllm.support:key_log_mooncake",
    engine: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An engine of ``world["model"]`` with the connector on the world's Mooncake store (``extra``: more
    of its extra config), its puts and gets recorded (``run["keys"]``, see :class:`KeyLog`)."""
    log = world["root"] / f"{name}.keys.jsonl"
    kv = connector({"backend": backend, "mooncake_config": str(world["mooncake_config"]), **extra})
    run = run_engine(
        world["root"],
        name,
        model=world["model"],
        engine=engine,
        env={**MOONCAKE_ENV, "AIOKV_TEST_KEY_LOG": str(log), **(env or {})},
        kv_transfer_config=kv,
        steps=steps,
    )
    run["keys"] = read_key_log(log)
    return run


def keys_of(run: dict[str, Any], op: str, containing: str) -> list[str]:
    """The keys of a key-logged run's ``op`` ("put" or "get") containing ``containing``, in order;
    every one of them must have succeeded."""
    found = [entry for entry in run["keys"] if entry["op"] == op]
    assert all(code >= 0 for entry in found for code in entry["codes"]), found
    return [key for entry in found for key in entry["keys"] if containing in key]


def generate(
    name: str, prompts: list[list[int]], max_tokens: int = 8, logprobs: bool = True, cache_salt: str = ""
) -> dict[str, Any]:
    return {
        "op": "generate",
        "name": name,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "cache_salt": cache_salt,
    }


def one_token_left(prompt: Sequence[int]) -> list[int]:
    """The control prompt for a hit that leaves one token to compute (a whole-prompt hit, or all but
    the last token): ``prompt``'s full blocks before its last token, and one token more, which vLLM's
    own prefix cache serves with exactly one token to compute. On an AMX CPU a prefill behind a cached
    prefix is bitwise a full prefill's when tens of tokens are left, but a one-token query takes
    another kernel path and moves the greedy logprob by up to ~0.08 (docs/vllm.md): only a control
    with one token left measures that."""
    return list(prompt[: (len(prompt) - 1) // BLOCK * BLOCK + 1])


def one_token_left_steps(prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """Steps for an engine without a connector: each prompt's :func:`one_token_left` computed whole
    (``one_left_cold<i>``), then again behind vLLM's own prefix cache (``one_left_warm<i>``), then the
    cache emptied; :func:`one_token_left_pairs` reads them."""
    steps: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        control = one_token_left(prompt)
        steps += [generate(f"one_left_cold{i}", [control]), generate(f"one_left_warm{i}", [control])]
        steps.append({"op": "evict"})
    return steps


def one_token_left_pairs(run: dict[str, Any], count: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The control pairs of :func:`one_token_left_steps` over ``count`` prompts (each warm run checked
    to have had one token to compute)."""
    pairs = []
    for i in range(count):
        (cold,), (warm,) = run[f"one_left_cold{i}"]["outputs"], run[f"one_left_warm{i}"]["outputs"]
        assert cold["cached"] == 0 and warm["cached"] % BLOCK == 0 and warm["cached"] > 0, (cold, warm)
        pairs.append((warm, cold))
    return pairs


# Bounds of the logprob tolerance. Floor: where a CPU's control is bitwise equal (AMX, tens of tokens
# computed behind a prefix), only rounding of the JSON floats remains. Cap: corrupted or foreign KV
# moves the greedy token's logprob by 1 or more (1.6 when concurrent loads once filled each other's
# blocks), so no control may widen the tolerance to where that would pass.
LOGPROB_TOLERANCE_FLOOR = 0.02
LOGPROB_TOLERANCE_CAP = 0.5


def first_difference(got: dict[str, Any], want: dict[str, Any]) -> int:
    """The first position where the greedy tokens differ (the shorter length if none does)."""
    pairs = zip(got["tokens"], want["tokens"], strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got["tokens"]), len(want["tokens"])))


def logprob_spread(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest difference of the greedy token's logprob over the positions where both runs chose
    the same tokens so far (after the first different token the contexts differ)."""
    same = first_difference(got, want)
    return max(
        (abs(a - b) for a, b in zip(got["logprobs"][:same], want["logprobs"][:same], strict=True)),
        default=0.0,
    )


def near_tie_gap(got: dict[str, Any], want: dict[str, Any], at: int) -> float:
    """How far apart the two runs' greedy tokens at position ``at`` were in whichever run ranked the
    other's token second (infinite unless one run did): a tie seen in either run's own numerics
    means the CPU alone may pick either token (vLLM's own connector does, tests/vllm/test_vllm_server.py,
    at two tokens whose logprobs printed equal)."""
    mine, theirs = got["tokens"][at], want["tokens"][at]
    gaps = [float("inf")]
    for run, other in ((want, mine), (got, theirs)):
        top = (
            dict((token, lp) for token, lp in run.get("top", [])[at]) if at < len(run.get("top", [])) else {}
        )
        if other in top:
            gaps.append(run["logprobs"][at] - top[other])
    return min(gaps)


def wait_until(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition`` every half second; AssertionError naming ``what`` if ``timeout`` passes first
    (a bound on a wait, never a speed figure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.5)


def cold_and_warm(suffix: str, prompt: list[int]) -> list[dict[str, Any]]:
    """Reference steps for one prompt: ``cold<suffix>`` computed whole, ``warm<suffix>`` with vLLM's own
    prefix cache reusing its blocks, then the cache emptied."""
    return [generate(f"cold{suffix}", [prompt]), generate(f"warm{suffix}", [prompt]), {"op": "evict"}]


def server_reference(
    server: Any, scenario: Sequence[Sequence[int]], also_alone: Sequence[Sequence[int]] = ()
) -> dict[str, Any]:
    """A no-connector server's reference: every distinct prompt of ``scenario`` and ``also_alone``
    answered alone ("solo", keyed by the prompt as a tuple), then ``scenario`` at once ("concurrent")."""
    distinct = {tuple(prompt): prompt for prompt in [*scenario, *also_alone]}
    solo = {key: server.complete(prompt).as_output() for key, prompt in distinct.items()}
    concurrent = [completion.as_output() for completion in server.complete_all(scenario)]
    return {"solo": solo, "concurrent": concurrent}


def solo_vs_concurrent_tolerance(reference: dict[str, Any], scenario: Sequence[Sequence[int]]) -> float:
    """The control of a server scenario: the same prompts alone and concurrently on the no-connector
    server (batching moves logprobs by up to ~0.1 on CPUs without AMX, up to ~0.06 on an AMX CPU)."""
    pairs = [
        (reference["solo"][tuple(prompt)], got)
        for prompt, got in zip(scenario, reference["concurrent"], strict=True)
    ]
    return greedy_tolerance(pairs)


def greedy_tolerance(controls: list[tuple[dict[str, Any], dict[str, Any]]]) -> float:
    """The logprob tolerance a test may use, from controls run on this machine in this test run: pairs
    of outputs that must agree but for the CPU's numerics (the same prompt alone and in a batch, or
    loaded by vLLM's own connector and computed, :func:`one_token_left_pairs`). On CPUs without AMX
    vLLM's "vec" attention kernels give a prefill after a hit and a full prefill logprobs up to ~0.06
    apart, and batching moves them up to ~0.1; with AMX a prefill behind a hit is bitwise equal unless
    one token is left to compute (up to ~0.08), and batching moves them by up to ~0.06. Twice the
    largest spread seen, within the floor and cap."""
    spread = max((logprob_spread(a, b) for a, b in controls), default=0.0)
    return min(max(2 * spread, LOGPROB_TOLERANCE_FLOOR), LOGPROB_TOLERANCE_CAP)


def assert_same_greedy(got: dict[str, Any], want: dict[str, Any], tolerance: float, what: str = "") -> None:
    """Greedy tokens equal and each greedy token's logprob within ``tolerance`` (see
    :func:`greedy_tolerance`), up to the end or up to a near-tie: a position where one run ranked the
    other's greedy token second, no more than ``tolerance`` below its own (:func:`near_tie_gap`). There the
    CPU's numerics alone may pick either (seen within ~0.06 on CPUs with and without AMX), and after
    it the contexts differ, so nothing later is compared. Wrong KV moves logprobs by 1 or more (1.6 when
    concurrent loads once filled each other's blocks) and fails here on any CPU."""
    same = first_difference(got, want)
    spread = logprob_spread(got, want)
    assert spread <= tolerance, (
        f"{what}: greedy logprobs differ by {spread:.4f} > {tolerance:.4f}: got {got['logprobs']}, "
        f"want {want['logprobs']}"
    )
    if same < min(len(got["tokens"]), len(want["tokens"])) and near_tie_gap(got, want, same) > tolerance:
        raise AssertionError(
            f"{what}: greedy tokens differ from position {same} (not a near-tie within {tolerance:.4f}): "
            f"got {got['tokens']} (top {got.get('top', [])[same : same + 1]}), want {want['tokens']} "
            f"(top {want.get('top', [])[same : same + 1]})"
        )
    assert len(got["tokens"]) == len(want["tokens"]), what


def assert_each_gets_the_prefix(
    run: dict[str, Any], ref: dict[str, Any], name: str, cached: int, tolerance: float
) -> None:
    """Step ``name`` of ``run`` (concurrent prompts sharing a stored prefix): each request got
    ``cached`` tokens, the greedy tokens of ``ref``'s ``cold_<name>`` (computed whole) and logprobs
    within ``tolerance`` of its ``warm_<name>`` (vLLM reusing the prefix from its own cache)."""
    for got, cold, warm in zip(
        run[name]["outputs"], ref[f"cold_{name}"]["outputs"], ref[f"warm_{name}"]["outputs"], strict=True
    ):
        assert got["cached"] == cached, got
        assert got["tokens"] == cold["tokens"]
        assert_same_greedy(got, warm, tolerance)


class CheckedSlowPuts:
    """A backend wrapper for the preemption test: every put copies the bytes it is about to store,
    waits ``delay_s`` (so the engine preempts the request while the store is in flight), stores, reads
    the value back and records whether it still equals the copy. A block reused by the engine before
    the store read it would show up as a mismatch (the bug class of vllm#52360), whatever the numerics.
    Results go to the JSON-lines file named by ``AIOKV_TEST_PUT_LOG``."""

    def __init__(self, inner: Any, delay_s: float, log_path: str) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.log_path = log_path
        self._scratch = np.zeros(64 << 20, dtype=np.uint8)
        self._scratch_lock = threading.Lock()  # puts run on several threads; one scratch buffer
        inner.register_buffer(self._scratch.ctypes.data, self._scratch.nbytes)

    def batch_put(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        import ctypes
        import time

        regions = [
            list(zip(np.asarray(a).tolist(), np.asarray(z).tolist(), strict=True))
            for a, z in zip(addrs, sizes, strict=True)
        ]
        before = [
            b"".join(ctypes.string_at(addr, size) for addr, size in key_regions) for key_regions in regions
        ]
        time.sleep(self.delay_s)
        codes: list[int] = self.inner.batch_put(keys, addrs, sizes)
        same = []
        for key, value, code in zip(keys, before, codes, strict=True):
            if code < 0 or len(value) > self._scratch.nbytes:
                continue
            with self._scratch_lock:
                read = self.inner.batch_get([key], [[self._scratch.ctypes.data]], [[len(value)]])
                same.append(read == [len(value)] and self._scratch[: len(value)].tobytes() == value)
        with open(self.log_path, "a") as log:
            log.write(json.dumps({"keys": len(keys), "checked": len(same), "equal": sum(same)}) + "\n")
        return codes

    def close(self) -> None:
        self.inner.unregister_buffer(self._scratch.ctypes.data)
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def slow_put_mooncake(config: Any, *, pure_client: bool) -> Any:
    """Backend factory for ``"backend": "tests.vllm.support:slow_put_mooncake"``: Mooncake with every
    put delayed and checked (:class:`CheckedSlowPuts`)."""
    from aiokv.integrations.vllm.common.backend_handles import new_mooncake_backend

    inner = new_mooncake_backend(config, pure_client=pure_client)
    return CheckedSlowPuts(
        inner, float(os.environ["AIOKV_TEST_PUT_DELAY_S"]), os.environ["AIOKV_TEST_PUT_LOG"]
    )


class KeyLog:
    """A backend wrapper recording, per put and get, the keys, their value sizes and the vLLM TP and PP
    ranks of the calling process (JSON lines appended to ``log_path``): which rank wrote and read
    which keys, for the tensor-parallel and MLA tests."""

    def __init__(self, inner: Any, log_path: str) -> None:
        self.inner = inner
        self.log_path = log_path

    def _log(self, op: str, keys: Any, sizes: Any, codes: list[int]) -> None:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            ranks: dict[str, int | None] = {
                "tp_rank": int(get_tensor_model_parallel_rank()),
                "pp_rank": int(get_pp_group().rank_in_group),
            }
        except Exception:  # no parallel groups in this process (a scheduler's lookup client)
            ranks = {"tp_rank": None, "pp_rank": None}
        entry = {
            "op": op,
            "pid": os.getpid(),
            **ranks,
            "keys": list(keys),
            "sizes": [int(np.asarray(z).sum()) for z in sizes],
            "codes": codes,
        }
        with open(self.log_path, "a") as log:
            log.write(json.dumps(entry) + "\n")

    def batch_put(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        codes: list[int] = self.inner.batch_put(keys, addrs, sizes)
        self._log("put", keys, sizes, codes)
        return codes

    def batch_get(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        codes: list[int] = self.inner.batch_get(keys, addrs, sizes)
        self._log("get", keys, sizes, codes)
        return codes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def key_log_mooncake(config: Any, *, pure_client: bool) -> Any:
    """Backend factory for ``"backend": "tests.vllm.support:key_log_mooncake"``: Mooncake, every put
    and get recorded (:class:`KeyLog`) in the JSON-lines file named by ``AIOKV_TEST_KEY_LOG``."""
    from aiokv.integrations.vllm.common.backend_handles import new_mooncake_backend

    return KeyLog(new_mooncake_backend(config, pure_client=pure_client), os.environ["AIOKV_TEST_KEY_LOG"])


def read_key_log(path: Path) -> list[dict[str, Any]]:
    """The entries :class:`KeyLog` wrote (none if the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TP2_ENGINE = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
_CPUS = sorted(os.sched_getaffinity(0))
# vLLM's multiprocess executor, one worker process per rank; threads bound by hand, one allowed core
# each (else: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").
PARALLEL_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_CPU_OMP_THREADS_BIND": f"{_CPUS[0]}|{_CPUS[1 % len(_CPUS)]}",
}


class _GetsWrapper:
    """A backend wrapper whose every get, a plain one or aiokv's read of another replica (Mooncake's
    backend: a failed get read again there), goes through :meth:`_get`; anything else is the inner
    backend's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def batch_get(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        return self._get(self.inner.batch_get, keys, addrs, sizes)

    def _get(self, get: Any, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name == "read_from_replicas":
            return functools.partial(self._get, method)
        return method


class FailingGets(_GetsWrapper):
    """A backend wrapper whose gets fail (``TRANSFER_FAILED``) while their keys stay listed: a key the
    store lists but cannot serve (e.g. a value of another size under the same key). Every get, or with
    ``only_keys_containing`` only the gets of keys containing it (one KV cache group's, say); a replica
    read of those keys fails too, or the retry would read their real values."""

    def __init__(self, inner: Any, only_keys_containing: str | None = None) -> None:
        super().__init__(inner)
        self.only_keys_containing = only_keys_containing

    def _get(self, get: Any, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        from aiokv import Code

        marker = self.only_keys_containing
        codes = [int(Code.TRANSFER_FAILED)] * len(keys)
        served = [i for i, key in enumerate(keys) if marker is not None and marker not in key]
        if served:
            answers = get([keys[i] for i in served], _rows(addrs, served), _rows(sizes, served))
            for index, code in zip(served, answers, strict=True):
                codes[index] = code
        return codes


class JitteredGets(_GetsWrapper):
    """A backend wrapper holding each get call back a random while (none, 50 ms or 300 ms, drawn per
    call): a request's gets finish out of order and many engine steps after the step that asked for
    them, so a load reported finished before its last get wrote the blocks, or a get whose bytes land
    in another request's blocks, changes outputs on any CPU, whatever its timing there. Every
    existence check waits 100 ms too: longer than the scheduler's first wait for a lookup
    (``lookup_wait_s``, 20 ms), so requests are answered "ask again" and take their hit steps later."""

    DELAYS_S = (0.0, 0.05, 0.3)
    EXISTS_DELAY_S = 0.1

    def __init__(self, inner: Any, seed: int) -> None:
        import random

        super().__init__(inner)
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # gets run on several transfer threads

    def _get(self, get: Any, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        import time

        with self._lock:
            delay = self._random.choice(self.DELAYS_S)
        time.sleep(delay)
        codes: list[int] = get(keys, addrs, sizes)
        return codes

    def batch_exists(self, keys: Any) -> list[bool]:
        import time

        time.sleep(self.EXISTS_DELAY_S)
        found: list[bool] = self.inner.batch_exists(keys)
        return found


def jittered_gets_mooncake(config: Any, *, pure_client: bool) -> Any:
    """Backend factory for ``"backend": "tests.vllm.support:jittered_gets_mooncake"``: Mooncake with
    every get held back at random (:class:`JitteredGets`, seeded by ``AIOKV_TEST_JITTER_SEED``)."""
    from aiokv.integrations.vllm.common.backend_handles import new_mooncake_backend

    inner = new_mooncake_backend(config, pure_client=pure_client)
    return JitteredGets(inner, int(os.environ.get("AIOKV_TEST_JITTER_SEED", "0")))


def _rows(regions: Any, rows: list[int]) -> Any:
    """``regions``' rows ``rows``, as the same kind of sequence (a backend call's arrays stay arrays)."""
    return regions[rows] if isinstance(regions, np.ndarray) else [regions[i] for i in rows]


def failing_gets_memory(config: Any, *, pure_client: bool) -> Any:
    """Backend factory for ``"backend": "tests.vllm.support:failing_gets_memory"``: the embedded store,
    every get failing (:class:`FailingGets`)."""
    from aiokv.backends.memory import MemoryBackend

    return FailingGets(MemoryBackend(capacity_bytes=config.memory_capacity))


def failing_group_gets_mooncake(config: Any, *, pure_client: bool) -> Any:
    """Backend factory for ``"backend": "tests.vllm.support:failing_group_gets_mooncake"``: Mooncake,
    every put and get recorded (:class:`KeyLog`, ``AIOKV_TEST_KEY_LOG``), and the gets of keys
    containing ``AIOKV_TEST_FAIL_KEYS_WITH`` (one KV cache group's) failing (:class:`FailingGets`)."""
    from aiokv.integrations.vllm.common.backend_handles import new_mooncake_backend

    logged = KeyLog(new_mooncake_backend(config, pure_client=pure_client), os.environ["AIOKV_TEST_KEY_LOG"])
    return FailingGets(logged, os.environ["AIOKV_TEST_FAIL_KEYS_WITH"])


def overwrite(backend: Any, keys: list[str], value: bytes) -> None:
    """Replace every key's value by ``value`` (a put keeps an existing key's value: remove first)."""
    backend.batch_remove(keys, force=True)
    buffer = np.frombuffer(value, dtype=np.uint8).copy()
    from tests.mooncake_support import registered

    with registered(backend, buffer) as addr:
        codes = backend.batch_put(keys, [[addr]] * len(keys), [[buffer.nbytes]] * len(keys))
    assert all(code >= 0 for code in codes), codes


def read_value(backend: Any, key: str, size: int) -> bytes:
    """The ``size``-byte value of ``key``, read with ``backend`` (a Mooncake client of the test's own)."""
    from tests.mooncake_support import registered

    buffer = np.zeros(size, dtype=np.uint8)
    with registered(backend, buffer) as addr:
        assert backend.batch_get([key], [[addr]], [[size]]) == [size]
    return buffer.tobytes()


def slow_key_log_mooncake(config: Any, *, pure_client: bool) -> Any:
    """Backend factory for ``"backend": "tests.vllm.support:slow_key_log_mooncake"``: Mooncake with
    every put delayed and checked (:class:`CheckedSlowPuts`) and every put and get recorded
    (:class:`KeyLog`): which keys a server acknowledged as stored, for stops with stores in flight."""
    return KeyLog(slow_put_mooncake(config, pure_client=pure_client), os.environ["AIOKV_TEST_KEY_LOG"])
