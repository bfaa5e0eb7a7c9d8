"""examples/vllm_offline.py runs as a user would run it: two engines share a cache through Mooncake."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.mooncake_support import require_mooncake
from tests.vllm.support import ROOT, require_vllm

pytestmark = pytest.mark.mooncake


def test_vllm_offline_example() -> None:
    require_vllm()
    require_mooncake()
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_offline.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hits = [int(n) for n in re.findall(r"hit\s+(\d+) tokens", done.stdout)]
    assert hits == [0, 2048], done.stdout  # engine 1 computes, engine 2 loads all 16 full blocks
    assert "same first token as without the cache: True" in done.stdout
