"""Two vLLM engines sharing a KV cache through aiokv: the first computes and stores a long prompt, the
second (another process, its own KV cache) loads it instead of recomputing it.

    python examples/vllm_offline.py            # the embedded store is per process: uses Mooncake
    python examples/vllm_offline.py --tokens 4000

It starts a loopback Mooncake master and a process holding the store's memory, writes a small
random-weight Llama, runs engine 1 (stores) and engine 2 (loads), and prints engine 2's hit tokens
and time to first token against a run without the cache. Needs vLLM (``pip install 'aiokv[vllm]'``)
and Mooncake (``'aiokv[mooncake-cpu]'``); run it inside a private network namespace
(``unshare -rn sh -c 'ip link set lo up && python examples/vllm_offline.py'``) if you want nothing to
listen beyond loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINE = """
import json, os, sys, time
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.distributed.kv_transfer import get_kv_transfer_group
from aiokv.integrations.vllm.common.amx import allow_amx_tiles

allow_amx_tiles()  # vLLM 0.32's CPU attention uses AMX without asking Linux first (docs/vllm.md)

model, config_path, prompt_path, use_cache = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
options = {}
if use_cache:
    options["kv_transfer_config"] = {
        "kv_connector": "AiokvConnector", "kv_connector_module_path": "aiokv.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "mooncake", "mooncake_config": config_path},
    }
llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=8192,
          load_format="safetensors", **options)
prompt = json.load(open(prompt_path))
params = SamplingParams(temperature=0, max_tokens=1, detokenize=False, ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)  # warm up
began = time.perf_counter()
(out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
ttft = time.perf_counter() - began
if use_cache:
    get_kv_transfer_group().flush(60)  # the stores must land before this process exits
result = {"ttft": ttft, "hit": out.num_cached_tokens, "token": out.outputs[0].token_ids[0]}
print("RESULT " + json.dumps(result))
"""


def run_engine(model: Path, config: Path, prompt: Path, use_cache: bool) -> dict[str, float]:
    env = {**os.environ, "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(config), str(prompt), "1" if use_cache else "0"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, float] = json.loads(line.removeprefix("RESULT "))
            return result
    raise SystemExit(f"the engine failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2100, help="prompt length (2,100: 16 full blocks)")
    args = parser.parse_args()

    import numpy as np

    from aiokv import MooncakeMaster, segment_holder
    from aiokv.testing.tiny_model import write_tiny_llama

    with tempfile.TemporaryDirectory() as tmp, MooncakeMaster() as master:
        root = Path(tmp)
        model = write_tiny_llama(root / "tiny-llama", num_layers=8)
        prompt = root / "prompt.json"
        prompt.write_text(json.dumps(np.random.default_rng(0).integers(3, 1000, args.tokens).tolist()))
        config = root / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "local_buffer_size": "64MB",
                }
            )
        )
        with segment_holder(master.address, "512MiB"):
            baseline = run_engine(model, config, prompt, use_cache=False)
            first = run_engine(model, config, prompt, use_cache=True)
            second = run_engine(model, config, prompt, use_cache=True)
    print(f"prompt: {args.tokens} tokens")
    for name, run in (("engine 1 (computes, stores)", first), ("engine 2 (loads)", second)):
        print(f"{name:28}: hit {run['hit']:5} tokens, time to first token {run['ttft']:.3f} s")
    print(f"{'no cache':28}: time to first token {baseline['ttft']:.3f} s")
    print(f"TTFT engine 2 / no cache: {second['ttft'] / baseline['ttft']:.2f}")
    print(f"same first token as without the cache: {second['token'] == baseline['token']}")


if __name__ == "__main__":
    main()
