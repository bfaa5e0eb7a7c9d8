"""The output comparison every vLLM test uses (``support.assert_same_greedy``), on made-up outputs:
what it accepts (CPU noise within the control's tolerance, a near tie broken either way) and what it
refuses (another greedy token with a clear winner, a logprob moved beyond the tolerance)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.support import (
    LOGPROB_TOLERANCE_CAP,
    LOGPROB_TOLERANCE_FLOOR,
    assert_same_greedy,
    greedy_tolerance,
    logprob_spread,
)


def output(
    tokens: list[int], logprobs: list[float], top: list[dict[int, float]] | None = None
) -> dict[str, Any]:
    """An output as the tests hold them (``top``: per position ``[token, logprob]``, best first)."""
    pairs = [sorted(([t, lp] for t, lp in p.items()), key=lambda pair: -pair[1]) for p in top or []]
    return {"tokens": tokens, "logprobs": logprobs, "cached": 0, **({"top": pairs} if top else {})}


WANT = output([5, 6, 7], [-0.5, -1.0, -0.2])


def test_equal_and_noisy_outputs_pass() -> None:
    assert_same_greedy(WANT, WANT, 0.0)
    assert_same_greedy(output([5, 6, 7], [-0.52, -0.97, -0.2]), WANT, 0.05)


def test_a_logprob_beyond_the_tolerance_fails() -> None:
    with pytest.raises(AssertionError, match=r"differ by 0\.0600"):
        assert_same_greedy(output([5, 6, 7], [-0.56, -1.0, -0.2]), WANT, 0.05)


def test_another_greedy_token_fails_unless_a_near_tie() -> None:
    with pytest.raises(AssertionError, match="differ from position 0"):
        assert_same_greedy(output([9, 6, 7], [-0.5, -1.0, -0.2]), WANT, 0.05)
    with pytest.raises(AssertionError):
        assert_same_greedy(output([5, 6, 7, 8], [-0.5, -1.0, -0.2, -0.1]), WANT, 0.05)  # one token more
    # Position 1 is a near tie in both runs (6 and 8 within 0.02): either may win, the texts then part.
    want = output([5, 6, 7], [-0.5, -1.00, -0.2], [{5: -0.5}, {6: -1.00, 8: -1.02}, {7: -0.2}])
    swapped = output([5, 8, 9], [-0.5, -1.01, -3.0], [{5: -0.5}, {8: -1.01, 6: -1.02}, {9: -3.0}])
    assert_same_greedy(swapped, want, 0.05)
    # A tie in one run's numerics is enough (vLLM's own connector broke a tie the reference printed as
    # exact while ranking the reference's token lower): the CPU alone may pick either token.
    tied_in_reference = output([5, 8, 9], [-0.5, -1.01, -3.0], [{5: -0.5}, {8: -1.01, 6: -1.31}, {9: -3.0}])
    assert_same_greedy(tied_in_reference, want, 0.05)
    # The same swap with a clear winner (0.3 apart) in both runs is no tie.
    clear_want = output([5, 6, 7], [-0.5, -1.00, -0.2], [{5: -0.5}, {6: -1.00, 8: -1.30}, {7: -0.2}])
    clear = output([5, 8, 9], [-0.5, -1.01, -3.0], [{5: -0.5}, {8: -1.01, 6: -1.31}, {9: -3.0}])
    with pytest.raises(AssertionError, match="differ from position 1"):
        assert_same_greedy(clear, clear_want, 0.05)
    # And a token neither run ranks second is no tie either.
    other = output([5, 4, 9], [-0.5, -1.01, -3.0], [{5: -0.5}, {4: -1.01, 3: -1.02}, {9: -3.0}])
    with pytest.raises(AssertionError, match="differ from position 1"):
        assert_same_greedy(other, want, 0.05)


def test_tolerance_from_a_control_has_a_floor_and_a_cap() -> None:
    assert greedy_tolerance([]) == LOGPROB_TOLERANCE_FLOOR
    assert greedy_tolerance([(WANT, output([5, 6, 7], [-0.53, -1.0, -0.2]))]) == pytest.approx(0.06)
    assert greedy_tolerance([(WANT, output([5, 6, 7], [-2.5, -1.0, -0.2]))]) == LOGPROB_TOLERANCE_CAP
    # The spread ends where the control's own tokens part.
    assert logprob_spread(WANT, output([5, 9, 7], [-0.51, -3.0, -0.2])) == pytest.approx(0.01)
