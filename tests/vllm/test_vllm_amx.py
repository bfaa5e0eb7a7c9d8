"""AMX tile permission (``aiokv.integrations.vllm.common.amx``) and the key tag that names AMX kernels.

vLLM 0.32's CPU attention executes AMX tile instructions without asking Linux for permission; in a
process where nothing asked, it dies with SIGILL. Each check runs in a fresh interpreter, so nothing
this test process already did (torch kernels that ask on their own) can grant the permission for it.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.vllm.support import ROOT, require_vllm

PROBE = """
import ctypes, json, platform
def tile_permission():
    # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 (XTILEDATA) once AMX tiles are allowed.
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    mask = ctypes.c_uint64(0)
    if ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask)) != 0:
        return None
    return bool(mask.value >> 18 & 1)
before = tile_permission()
from aiokv.integrations.vllm.common.amx import allow_amx_tiles, amx_tiles_supported
from aiokv.integrations.vllm.common.block_keys import device_tag
supported = amx_tiles_supported()
allowed = allow_amx_tiles()
print(json.dumps({"before": before, "supported": supported, "allowed": allowed,
                  "after": tile_permission(), "tag": device_tag()}))
"""


@pytest.fixture(scope="module")
def probed() -> dict[str, object]:
    """One fresh interpreter's answers (importing vLLM takes seconds): both tests read them."""
    require_vllm()
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_allow_amx_tiles_grants_the_permission_where_the_cpu_has_amx(probed: dict[str, object]) -> None:
    result = probed
    if result["supported"]:
        assert result["allowed"] is True
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            assert result["after"] is True, result
    else:
        assert result["allowed"] is False
        assert result["after"] in (False, None), result


def test_the_cpu_key_tag_names_amx_apart(probed: dict[str, object]) -> None:
    result = probed
    tag = str(result["tag"])
    assert tag.startswith("cpu-"), tag
    assert tag.endswith("-amx") == bool(result["supported"]), result
