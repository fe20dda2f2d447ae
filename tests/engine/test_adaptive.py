"""The adaptive rule: a row proposes only as many tokens as pay on this machine."""

from __future__ import annotations

import logging

import pytest

from app.engine.speculative.adaptive import (
    BACKOFF_FIRST,
    Adaptive,
    FreeVerify,
    RowRate,
    StepCosts,
    expected_tokens,
)


class LinearCosts:
    """A verify step of k tokens costs ``1 + slope * k`` plain steps (a small CPU's shape)."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def observe(self, k: int, seconds: float) -> None:
        pass

    def ratio(self, k: int) -> float:
        return 1.0 + self.slope * k


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_step_costs_are_measured_per_proposal_length():
    costs = StepCosts()
    assert costs.ratio(4) == pytest.approx(1.4)  # the prior until measured
    costs.observe(0, 5.0)
    costs.observe(4, 9.0)  # the first step of each length sets it up: not a measure
    costs.observe(4, 0.030)  # no plain step to compare with yet: not counted
    assert costs.ratio(4) == pytest.approx(1.4)
    for _ in range(3):
        costs.observe(0, 0.010)
        costs.observe(4, 0.030)
    assert costs.ratio(4) == pytest.approx(3.0)
    # The machine gets busier: plain and verify steps both slow down; the ratio holds.
    for _ in range(40):
        costs.observe(0, 0.020)
        costs.observe(4, 0.060)
    assert costs.ratio(4) == pytest.approx(3.0, rel=0.05)


def test_a_good_drafter_runs_long_where_verifying_is_free():
    rule = Adaptive(8, FreeVerify())
    row = RowRate.prior("prediction")
    assert rule.tokens(row, "prediction", "r") == 2  # a new row's first proposal is a probe
    row.update(2, 2)
    assert rule.tokens(row, "prediction", "r") == 8


def test_a_drafter_that_does_not_pay_is_turned_off_with_a_log_and_probed_later(caplog):
    rule = Adaptive(4, LinearCosts(0.9))  # a verify costs nearly a plain step per token
    row = RowRate.prior("prompt_lookup")
    assert rule.tokens(row, "prompt_lookup", "r") == 2
    row.update(2, 0)
    with caplog.at_level(logging.DEBUG, logger="tandem.engine"):
        assert rule.tokens(row, "prompt_lookup", "r") == 0
    assert "prompt_lookup off for" in caplog.text and "request r" in caplog.text
    pause = row.off_for
    assert pause >= BACKOFF_FIRST
    asked = [rule.tokens(row, "prompt_lookup", "r") for _ in range(pause)]
    assert asked[:-1] == [0] * (pause - 1) and asked[-1] == 2  # the probe
    row.update(2, 0)
    assert rule.tokens(row, "prompt_lookup", "r") == 0 and row.off_for > pause  # longer pause each time


def test_the_same_drafter_pays_on_a_cheap_verify_and_not_on_a_dear_one():
    rate = RowRate(kept=0.7 * 10, trials=10)
    assert Adaptive(4, LinearCosts(0.05)).best(rate.rate)[0] >= 3
    assert Adaptive(4, LinearCosts(0.9)).best(rate.rate)[0] == 0


def test_probes_cost_little_where_verifying_is_dear():
    """Free chat on a small CPU: a drafter that keeps nothing, probed again and again,
    costs under the margin in all (the probes' surplus over plain steps)."""
    costs = LinearCosts(0.9)
    rule = Adaptive(4, costs)
    row = RowRate.prior("prompt_lookup")
    steps, surplus = 2000, 0.0
    for _ in range(steps):
        k = rule.tokens(row, "prompt_lookup", "r")
        if k:
            surplus += costs.ratio(k) - 1.0
            row.update(k, 0)
    assert surplus / steps < 0.05


def test_an_unmeasured_length_is_guessed_from_the_measured_ones():
    costs = StepCosts()
    for _ in range(2):
        costs.observe(0, 0.010)
        costs.observe(2, 0.030)  # 1.0 plain step per proposed token
    assert costs.ratio(1) == pytest.approx(2.0) and costs.ratio(4) == pytest.approx(5.0)
