"""Every ```python block of README.md and docs/*.md runs, each in a fresh interpreter.

A block that cannot run standalone (a signature listing, the Protocol sketch) is fenced
```python no-run and is skipped explicitly, with its place named. A block fenced ```python mooncake
needs a real master: it runs where the Mooncake tests run and skips (fails under CI) where they skip.
Any other info string after ``python`` is refused, so a typo cannot silently skip a block.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .mooncake_support import require_mooncake

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*(.*?)\s*$")
RUN, NO_RUN, MOONCAKE = "", "no-run", "mooncake"
MIN_RUNNABLE_BLOCKS = 12  # README 1, api.md 8, backends.md 2, reliability.md 1 when this was written


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    options: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    blocks = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        fence, language, options = match.groups()
        end = index + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if language == "python":
            blocks.append(Block(path, index + 1, options, "\n".join(lines[index + 1 : end]) + "\n"))
        index = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


def test_every_python_block_is_marked_run_or_no_run() -> None:
    odd = [f"{b.name}: ```python {b.options}" for b in BLOCKS if b.options not in (RUN, NO_RUN, MOONCAKE)]
    assert not odd, f"unknown fence options (use ```python, ```python no-run or ```python mooncake): {odd}"


def test_enough_blocks_run() -> None:
    runnable = [b for b in BLOCKS if b.options == RUN]
    assert len(runnable) >= MIN_RUNNABLE_BLOCKS, [b.name for b in runnable]
    # Every document in docs/ that has Python in it has at least one block that runs.
    assert {b.path.name for b in runnable} >= {"README.md", "api.md", "backends.md"}


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b, id=b.name, marks=[pytest.mark.mooncake] if b.options == MOONCAKE else [])
        for b in BLOCKS
    ],
)
def test_block_runs(block: Block) -> None:
    if block.options == NO_RUN:
        pytest.skip(f"{block.name} is marked ```python no-run")
    if block.options == MOONCAKE:
        require_mooncake()
    result = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"{block.name} failed:\n{block.code}\n--- stderr ---\n{result.stderr}"
