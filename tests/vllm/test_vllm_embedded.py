"""AiokvConnector with the embedded store in one in-process engine: offload beyond vLLM's own prefix
cache. The prompt's blocks are stored, vLLM's prefix cache is dropped, and the prompt comes back from
the store: outputs equal the first (computed) run's."""

from __future__ import annotations

from pathlib import Path

from aiokv.integrations.vllm.tiny_model import write_tiny_llama
from tests.vllm.support import BLOCK, connector, generate, require_vllm, run_engine, same_outputs, tokens


def test_store_evict_reload(tmp_path: Path) -> None:
    require_vllm()
    model = write_tiny_llama(tmp_path / "tiny-llama")
    prompt = tokens(40, 2100)
    out = run_engine(
        tmp_path,
        "embedded",
        model=model,
        kv_transfer_config=connector({"backend": "memory", "memory_capacity": "64MiB"}),
        steps=[
            generate("computed", [prompt]),
            {"op": "flush"},
            {"op": "evict"},
            generate("reloaded", [prompt]),
            {"op": "stats"},
        ],
    )
    assert out["evict"] is True  # vLLM's prefix cache was dropped: the hit below is the store's
    (computed,) = out["computed"]["outputs"]
    (reloaded,) = out["reloaded"]["outputs"]
    assert computed["cached"] == 0
    assert reloaded["cached"] == 16 * BLOCK
    assert same_outputs(reloaded, computed)
    assert out["stats"]["chunks"]["loaded"] == 4 and out["stats"]["chunks"]["stored"] == 4
