"""How the chaos run and `make test-hosts` judge one output against the reference
(`benchmarks.chaos.traffic._compare`)."""

from __future__ import annotations

from benchmarks.chaos.traffic import Result, _compare

REF = {"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -0.25],
       "runner_up": [[9, -0.6], [8, -1.0 - 5e-6], [4, -3.0]]}


def _judge(ids: list[int], lps: list[float | None]) -> tuple[str | None, Result]:
    res = Result(0, False, "g")
    return _compare(res, ids, lps, REF, 3), res


def test_identical_output_is_ok_and_its_drift_measured() -> None:
    why, res = _judge([5, 6, 7], [-0.5, -1.001, -0.25])
    assert why is None and abs(res.logprob_drift - 0.001) < 1e-9


def test_an_exact_tie_taken_the_other_way_is_ok() -> None:
    why, res = _judge([5, 8, 1], [-0.5, -1.0, -2.0])
    assert why is None and res.tie_at == 1


def test_a_difference_names_what_came_against_the_reference_and_its_runner_up() -> None:
    why, _ = _judge([9, 6, 7], [-0.6, -1.0, -0.25])
    assert why == ("tokens differ from the reference from position 0: got 9 (logprob -0.6), "
                   "reference 5 (-0.5), its runner-up 9 (-0.6)")


def test_a_short_output_says_how_long_it_was() -> None:
    why, _ = _judge([5, 6], [-0.5, -1.0])
    assert why == "2 tokens, asked 3 (first difference at 2)"
