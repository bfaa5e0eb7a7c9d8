"""Every example runs as a user would run it (a fresh interpreter, from the repository root) and
reports success; their byte checks are shown to catch a corrupted block.

``examples/prefill_decode.py`` is exercised by ``tests/test_examples_prefill_decode.py`` (it needs a
Mooncake master).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 60) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in:\n{text}"
    return int(match.group(1).replace(",", ""))


def test_quickstart() -> None:
    out = run_example("quickstart.py")
    assert "stored : 3 chunks written, 0 skipped, 0 failed" in out
    assert "lookup : 192 of 200 tokens are in the store" in out
    assert "loaded : 192 tokens, blocks to recompute: ((),)" in out
    assert "byte for byte: OK" in out


def test_async_server() -> None:
    out = run_example("async_server.py", "--requests", "120", "--duration", "30", "--arrival-ms", "0.5")
    assert number(r"done     : (\d+) finished", out) == 120
    assert "0 running, 0 waiting" in out
    # Shared system prompts and continued conversations: most requests find a cached prefix.
    hits = number(r"hits     : (\d+) of 120 requests hit", out)
    assert 0 < hits < 120  # the very first request cannot hit
    loaded = number(r"requests hit; ([\d,]+) of", out)
    prompt_tokens = number(r" of ([\d,]+) prompt tokens loaded", out)
    assert 0 < loaded < prompt_tokens
    assert number(r"transfers: (\d+) chunks written", out) > 0
    assert number(r"already stored, (\d+) failed", out) == 0
    assert re.search(r"loop lag : p50 [\d.]+ ms, p99 [\d.]+ ms, max [\d.]+ ms over \d+ ticks", out)
    assert number(r"verify   : (\d+) loaded blocks", out) == loaded // 16  # every loaded block checked
    assert out.rstrip().endswith("OK")


def test_async_server_stops_at_its_duration() -> None:
    # More requests than it can serve in the time given: it stops, drains its transfers, exits 0.
    out = run_example("async_server.py", "--requests", "5000", "--duration", "0.5", "--arrival-ms", "0.05")
    assert number(r"done     : (\d+) finished", out) < 5000
    assert out.rstrip().endswith("OK")


def test_sync_engine() -> None:
    out = run_example("sync_engine.py", "--requests", "30")
    hits = number(r"hits     : (\d+) of 30 requests hit", out)
    assert 0 < hits < 30
    assert number(r"transfers: (\d+) chunks written", out) > 0
    assert "0 stores unfinished" in out
    assert "verify   : loaded blocks equal a fresh prefill: OK" in out


def test_the_examples_byte_checks_catch_a_corrupted_block() -> None:
    sync_engine = load_example("sync_engine")
    prompt = np.arange(100)
    blocks = np.array([5, 3, 9, 0, 7, 1, 2])
    cache = [np.zeros((16, sync_engine.BLOCK_BYTES), dtype=np.uint8) for _ in range(sync_engine.REGIONS)]
    sync_engine.prefill(cache, prompt, blocks, 0)
    assert sync_engine.count_bad_blocks(cache, prompt, blocks) == 0
    cache[3][9, 100] ^= 1
    assert sync_engine.count_bad_blocks(cache, prompt, blocks) == 1

    server = load_example("async_server")
    seeds = server.block_seeds(prompt)
    assert seeds.size == 7  # six whole blocks and a partial one
    # Causal: a block's value depends on the tokens up to its end, and on nothing after.
    changed = prompt.copy()
    changed[40] += 1
    other = server.block_seeds(changed)
    assert np.array_equal(other[:2], seeds[:2]) and not np.any(other[2:] == seeds[2:])
    assert not np.array_equal(server.block_kv(seeds, 0), server.block_kv(seeds, 1))
