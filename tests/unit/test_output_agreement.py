"""The engine tests' agreement rule: identical outputs, or a parting at a rounding tie only."""
import pytest

from tests.support.engine_support import TIE_NATS, assert_same_outputs


def run(outputs, top_logprobs):
    return {"outputs": outputs, "top_logprobs": top_logprobs}


def test_identical_outputs_agree():
    a = run([[1, 2, 3]], [[[[1, -0.1]], [[2, -0.1]], [[3, -0.1]]]])
    assert_same_outputs(a, a)


def test_parting_at_a_near_tie_is_accepted():
    first = run([[5, 7, 9]], [[[[5, -0.1], [6, -3.0]], [[7, -0.6930], [8, -0.6935]], [[9, -0.2]]]])
    second = run([[5, 8, 4]], [[[[5, -0.1], [6, -3.0]], [[8, -0.6931], [7, -0.6933]], [[4, -0.3]]]])
    assert_same_outputs(first, second)


def test_parting_beyond_a_tie_fails_and_names_the_request():
    first = run([[5, 7]], [[[[5, -0.1]], [[7, -0.5], [8, -0.5 - 10 * TIE_NATS]]]])
    second = run([[5, 8]], [[[[5, -0.1]], [[8, -0.5], [7, -0.5 - 10 * TIE_NATS]]]])
    with pytest.raises(AssertionError, match="request 0 diverges at output token 1"):
        assert_same_outputs(first, second)


def test_a_token_outside_the_other_runs_top_list_fails():
    first = run([[7]], [[[[7, -0.1], [3, -2.0]]]])
    second = run([[8]], [[[[8, -0.1], [3, -2.0]]]])
    with pytest.raises(AssertionError, match="more than a rounding tie"):
        assert_same_outputs(first, second)
