"""One vLLM engine run, in its own process: ``python tests/vllm/engine_job.py JOB.json OUT.json``.

The job names the model, the engine options, the KV connector (or none) and a list of steps; the
results (greedy tokens, their logprobs, prefix-cache hits, connector stats) go to OUT.json. Tests run
each engine in a process of its own so that storing and loading engines never share memory.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def _connector_stats() -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    stats = getattr(connector, "stats", None)
    return stats() if stats is not None else {}


def _summary(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs or [], tokens, strict=False)]
    # The two most likely tokens at each position, most likely first: a near-tie shows in their gap.
    top = [
        sorted(([int(k), v.logprob] for k, v in lp.items()), key=lambda kv: -kv[1])[:2]
        for lp in completion.logprobs or []
    ]
    return {"tokens": tokens, "logprobs": logprobs, "top": top, "cached": output.num_cached_tokens}


def _drain(llm: Any, timeout: float) -> None:
    """Step the engine until its scheduler holds no request, as a server's engine loop does:
    ``LLM.generate`` returns before the step that hands finished requests' last stores (their prompts'
    partial last blocks) to the connector and before their blocks are released."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return  # the engine core runs in a process of its own, stepping by itself
    deadline = time.monotonic() + timeout
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()


def _reset_prefix_cache(llm: Any, timeout: float) -> bool:
    """Drop vLLM's prefix cache once no request holds blocks (vLLM refuses while one does; a finished
    request's blocks are held until the connector's stores of them are done)."""
    deadline = time.monotonic() + timeout
    while not (done := bool(llm.reset_prefix_cache())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return done


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as file:
        job = json.load(file)
    os.environ.update({key: str(value) for key, value in job.get("env", {}).items()})
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM compiles its logprob ranking with torch.compile: ~8 s per process on a CPU, for nothing here.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from aiokv.integrations.vllm.common.amx import allow_amx_tiles

    allow_amx_tiles()  # engines without the connector too (see the module)

    options: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "load_format": "safetensors",
        "num_gpu_blocks_override": 96,
        "disable_log_stats": True,
    }
    options.update(job.get("engine", {}))
    if isinstance(options.get("kv_events_config"), dict):  # LLM takes only the config object
        from vllm.config import KVEventsConfig

        options["kv_events_config"] = KVEventsConfig(**options["kv_events_config"])
    if job.get("kv_transfer_config"):
        options["kv_transfer_config"] = job["kv_transfer_config"]
    started = time.monotonic()
    llm = LLM(model=job["model"], **options)
    results: dict[str, Any] = {"start_s": time.monotonic() - started}
    for step in job["steps"]:
        op = step["op"]
        if op == "generate":
            params = SamplingParams(
                temperature=0,
                detokenize=False,
                ignore_eos=True,
                max_tokens=step.get("max_tokens", 8),
                logprobs=2 if step.get("logprobs", True) else None,
            )
            salt = {"cache_salt": step["cache_salt"]} if step.get("cache_salt") else {}
            prompts = [TokensPrompt(prompt_token_ids=p, **salt) for p in step["prompts"]]  # type: ignore[typeddict-item]
            began = time.monotonic()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.monotonic() - began
            results[step["name"]] = {"seconds": elapsed, "outputs": [_summary(o) for o in outputs]}
        elif op == "flush":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            _drain(llm, step.get("timeout", 60))
            results[step.get("name", "flush")] = get_kv_transfer_group().flush(step.get("timeout", 60))
        elif op == "evict":
            # One short request lets the engine report finished stores and free their blocks; then the
            # local prefix cache is dropped, so later hits can only come from the connector.
            # Another prompt each time, in every engine: this one's last partial block is stored, and a
            # later one equal to it would be loaded (os.urandom: vLLM seeds ``random`` alike everywhere).
            llm.generate(
                [TokensPrompt(prompt_token_ids=[7, *(100 + b % 800 for b in os.urandom(3))])],
                SamplingParams(max_tokens=1),
                use_tqdm=False,
            )
            _drain(llm, step.get("timeout", 60))  # blocks held for stores (a prompt's tail) are freed
            results[step.get("name", "evict")] = _reset_prefix_cache(llm, step.get("timeout", 60))
        elif op == "drain":
            _drain(llm, step.get("timeout", 60))
        elif op == "stats":
            results[step.get("name", "stats")] = _connector_stats()
        elif op == "scheduler_stats":  # the scheduler's connector: an object of this in-process engine
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            results[step.get("name", "scheduler_stats")] = connector.stats()
        elif op == "kill":
            os.kill(step["pid"], signal.SIGKILL)
        elif op == "sleep":
            time.sleep(step["seconds"])
        else:
            raise ValueError(f"unknown step {op!r}")
    with open(out_path, "w") as file:
        json.dump(results, file)
    sys.stdout.flush()
    # Leave at once: the connector's exit hooks close the store clients.
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
