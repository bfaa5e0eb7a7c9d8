"""The README's demo: in-process through ``aiokv.demo.main`` and as ``python -m aiokv demo``."""

from __future__ import annotations

import io
import re
import subprocess
import sys

from aiokv.demo import main

SMALL = ["--tokens", "1024", "--layers", "2", "--block-size", "16", "--chunk-tokens", "128"]


def test_demo_main_verifies_every_byte() -> None:
    out = io.StringIO()
    assert main(SMALL, out=out) == 0
    text = out.getvalue()
    assert re.search(r"^verify\s*: .* compared byte for byte: OK$", text, re.MULTILINE), text
    # 1024 tokens in 128-token chunks: 8 chunks stored once, then all skipped; all 1024 tokens hit.
    assert re.search(r"^store\s*: 8 chunks written, 0 skipped, 0 failed", text, re.MULTILINE), text
    assert re.search(r"^store x2: 0 written, 8 skipped", text, re.MULTILINE), text
    assert re.search(r"^lookup\s*: 1024 of 1032 tokens hit", text, re.MULTILINE), text
    assert re.search(r"^load\s*: 1024 tokens .* 0 blocks to recompute$", text, re.MULTILINE), text
    assert text.rstrip().endswith("demo OK")


def test_python_m_aiokv_demo_exits_zero() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aiokv", "demo", *SMALL],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compared byte for byte: OK" in done.stdout
    assert done.stdout.rstrip().endswith("demo OK")
