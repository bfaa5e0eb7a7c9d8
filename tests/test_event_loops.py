import asyncio

import pytest

pytestmark = pytest.mark.loop_matters  # also on uvloop (tests/conftest.py)


@pytest.mark.asyncio
async def test_loop_kind(request: pytest.FixtureRequest) -> None:
    loop = asyncio.get_running_loop()
    expected = "uvloop" if "uvloop" in request.node.name else "asyncio"
    assert (type(loop).__module__.startswith("uvloop")) == (expected == "uvloop")
