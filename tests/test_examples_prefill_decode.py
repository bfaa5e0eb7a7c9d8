"""``examples/prefill_decode.py`` end to end: three processes, one Mooncake master, bytes verified.

Skipped (failed under CI) where a real master cannot run, like the other Mooncake tests; run with
    unshare -rn sh -c 'ip link set lo up && python -m pytest tests/test_examples_prefill_decode.py'
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiokv.backends.mooncake_master import MooncakeMaster

from .mooncake_support import require_mooncake

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prefill_decode.py"
HANG_GUARD_S = 180  # the example takes seconds; this only stops a hung run


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


@pytest.mark.mooncake
def test_prefill_decode_with_its_own_master_verifies_every_chunk() -> None:
    require_mooncake()
    result = run_example()
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("router: started mooncake_master (pid ") for line in lines), lines
    assert "prefill: stored 24 chunks (skipped 0, failed 0) of 1557 tokens, 15.0 MiB" in result.stdout
    assert "decode: lookup found 1536 of 1557 tokens; loaded 24 chunks (1536 tokens)" in result.stdout
    verified = "decode: verified 24 of 24 chunks x 2 groups (15.0 MiB) against the prefill checksums: OK"
    assert verified in lines
    assert "MISMATCH" not in result.stdout
    assert lines[-1] == "router: prefill -> decode OK"


def test_prefill_decode_against_a_given_master_catches_a_corrupted_chunk(
    mooncake_master: MooncakeMaster,
) -> None:
    result = run_example("--master", mooncake_master.address, "--chunks", "8", "--simulate-corruption", "3")
    assert result.returncode == 3, result.stdout + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert f"router: using the mooncake_master at {mooncake_master.address}" in lines
    assert "prefill: stored 8 chunks (skipped 0, failed 0)" in result.stdout
    assert "loaded 8 chunks (512 tokens)" in result.stdout
    mismatches = [line for line in lines if "MISMATCH" in line]
    assert len(mismatches) == 1, lines  # exactly the flipped chunk, in the group it was flipped in
    assert mismatches[0].startswith("decode: MISMATCH in group 0 (full_attention), chunk 3: ")
    assert not any(line.startswith("decode: verified") for line in lines)
    assert lines[-1] == "router: prefill -> decode FAILED"
    assert mooncake_master.running  # a given master is left running
