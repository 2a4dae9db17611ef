"""optq.eval.verify.compare: tokens equal up to the first near-tie, log-probabilities within
the engine's tolerance. The records here are constructed, so each rule is met exactly once."""

from __future__ import annotations

from optq.eval.verify import ENGINES, Engine, compare

ENGINE = Engine("test", "a constructed engine", tie=0.01, logprob=0.01, decode=lambda *a: {})


def _recorded(steps: list[list[tuple[int, float]]]) -> dict:
    return {"text": "p", "tokens": [s[0][0] for s in steps], "top_logprobs": [[list(x) for x in s] for s in steps]}


RECORD = _recorded(
    [
        [(5, -0.1), (6, -2.5)],
        [(7, -0.690), (8, -0.695)],  # a near-tie: gap 0.005 < 0.01
        [(9, -0.2), (1, -1.9)],
    ]
)


def test_identical_output_agrees_with_zero_difference() -> None:
    out = {"tokens": [5, 7, 9], "logprobs": [{5: -0.1, 6: -2.5}, {7: -0.690, 8: -0.695}, {9: -0.2, 1: -1.9}]}
    r = compare(0, RECORD, out, ENGINE)
    assert r.ok and r.steps == 3 and r.tie_at is None and r.max_diff == 0.0


def test_other_token_at_a_near_tie_is_not_a_disagreement() -> None:
    out = {"tokens": [5, 8, 2], "logprobs": [{5: -0.1, 6: -2.5}, {8: -0.69, 7: -0.70}, {2: -0.1}]}
    r = compare(0, RECORD, out, ENGINE)
    assert r.ok and r.tie_at == 1 and r.steps == 1  # the steps after it follow another prefix: not compared


def test_other_token_where_the_record_is_clear_disagrees() -> None:
    out = {"tokens": [6, 7, 9], "logprobs": [{6: -0.3, 5: -0.4}, {7: -0.69}, {9: -0.2}]}
    r = compare(0, RECORD, out, ENGINE)
    assert not r.ok and "step 0" in r.mismatch and "token 6" in r.mismatch and r.steps == 0


def test_the_same_token_with_a_logprob_off_beyond_tolerance_disagrees() -> None:
    out = {"tokens": [5, 7, 9], "logprobs": [{5: -0.1, 6: -2.5}, {7: -0.690, 8: -0.695}, {9: -0.25, 1: -1.9}]}
    r = compare(0, RECORD, out, ENGINE)
    assert not r.ok and "step 2" in r.mismatch and abs(r.max_diff - 0.05) < 1e-9


def test_a_near_tie_for_one_engine_is_a_disagreement_for_a_stricter_one() -> None:
    strict = ENGINES["optq-exact"]
    assert strict.tie < 0.005 < ENGINE.tie
    out = {"tokens": [5, 8, 2], "logprobs": [{5: -0.1, 6: -2.5}, {8: -0.69}, {2: -0.1}]}
    assert not compare(0, RECORD, out, strict).ok


def test_a_short_output_disagrees() -> None:
    r = compare(0, RECORD, {"tokens": [5], "logprobs": [{5: -0.1, 6: -2.5}]}, ENGINE)
    assert not r.ok and "stopped after 1 of 3" in r.mismatch


def test_a_tail_token_is_not_compared_but_one_above_the_floor_is() -> None:
    # vLLM's bfloat16 on SmolLM2: the greedy token at 99.96%, a top-5 tail token at -8.6 served at -7.8.
    record = _recorded([[(35, -0.0004), (37, -4.9), (34, -8.6)]])
    tail = {"tokens": [35], "logprobs": [{35: -0.0004, 37: -4.9, 34: -6.6}]}  # off by 2, below the floor
    r = compare(0, record, tail, ENGINE)
    assert r.ok and r.steps == 1 and r.max_diff == 0.0
    above = {"tokens": [35], "logprobs": [{35: -0.0004, 37: -4.8, 34: -8.6}]}  # -4.9 is above the floor
    r = compare(0, record, above, ENGINE)
    assert not r.ok and "step 0" in r.mismatch and abs(r.max_diff - 0.1) < 1e-9
