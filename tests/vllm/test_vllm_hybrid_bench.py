"""``python -m benchmarks vllm --sliding-window N``: the hybrid model the benchmark writes (no engine runs
here; docs/benchmarks.md has the run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.vllm import _parser, model_layer_types, write_model
from benchmarks.vllm_workload import MODEL_SHAPE
from tests.vllm.support import require_vllm


def test_sliding_window_option_alternates_window_and_full_layers() -> None:
    assert _parser().parse_args([]).sliding_window == 0
    assert model_layer_types(4, 0) is None
    assert model_layer_types(4, 256) == (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    )


def test_the_benchmark_writes_its_model_with_the_window(tmp_path: Path) -> None:
    require_vllm()  # torch and safetensors come with it
    args = argparse.Namespace(sliding_window=256, seed=0)
    shape = dict(MODEL_SHAPE, num_layers=4)
    config = json.loads(
        (write_model(tmp_path / "m", shape, model_layer_types(4, 256), args) / "config.json").read_text()
    )
    assert config["sliding_window"] == 256 and config["num_hidden_layers"] == 4
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    plain = json.loads((write_model(tmp_path / "p", shape, None, args) / "config.json").read_text())
    assert "layer_types" not in plain and "sliding_window" not in plain
    # Same weights either way: only the config differs.
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (
        tmp_path / "p" / "model.safetensors"
    ).read_bytes()
