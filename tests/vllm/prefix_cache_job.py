"""``engine_job.py`` with vLLM's own prefix cache kept on for MLA models on CPU.

vLLM turns prefix caching (and chunked prefill) off for MLA models on CPUs without AMX, so no plain
run reuses a prefix there; the connector's loads still make the engine compute a prompt behind a
prefix. The MLA tests' reference runs use this job, so that vLLM itself reuses the same prefix (the
same split into reused and computed tokens) and the outputs can be compared bitwise.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def keep_prefix_caching() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        os.environ.update({key: str(value) for key, value in json.load(file).get("env", {}).items()})
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    keep_prefix_caching()
    from tests.vllm.engine_job import main

    main(sys.argv[1], sys.argv[2])
