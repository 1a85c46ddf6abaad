"""Grading without training: how GradePolicy turns a stream of incidents into severities and
actions (decisions.py). Each test feeds steps the way the monitor does, one grade per incident."""

import pytest

from megatron_patches.config import Config
from megatron_patches.decisions import GradePolicy

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


def policy(check_interval=1, **response):
    recovery = response.pop("recovery", {})
    return GradePolicy(Config.from_dict({"check_interval": check_interval, "response": response,
                                         "recovery": recovery}))


def grades(p, steps, origin_replicas=1, rollbacks_done=0, can_replay=True):
    return [p.grade(s, origin_replicas, rollbacks_done, can_replay) for s in steps]


def test_a_single_anomaly_is_a_warning_that_skips_the_step_and_asks_for_a_replay():
    decision = policy().grade(7, 1, 0, can_replay=True)
    assert (decision.severity, decision.action, decision.reason) == ("warning", "skip_step", "single anomaly")
    assert decision.step == 7 and decision.replay is True and list(decision.origins) == []


@pytest.mark.parametrize("can_replay, replay_on, expected", [
    (True, True, True), (False, True, False), (True, False, False), (False, False, False)])
def test_replay_needs_both_a_loop_that_offers_it_and_the_config(can_replay, replay_on, expected):
    warning = policy(replay=replay_on).grade(1, 1, 0, can_replay)
    error = grades(policy(replay=replay_on), [1, 2], can_replay=can_replay)[-1]
    assert warning.replay is expected and error.replay is expected
    assert error.severity == "error"


def test_anomalies_on_two_consecutive_checked_steps_are_an_error_that_rolls_back():
    first, second = grades(policy(), [10, 11])
    assert first.severity == "warning"
    assert (second.severity, second.action) == ("error", "rollback")
    assert second.reason == "anomaly on 2 consecutive checked steps"


def test_consecutive_means_consecutive_checks_under_a_check_interval():
    assert [d.severity for d in grades(policy(check_interval=3), [3, 6])] == ["warning", "error"]
    assert [d.severity for d in grades(policy(check_interval=3), [3, 7])] == ["warning", "warning"]


def test_a_gap_starts_the_consecutive_count_again():
    decisions = grades(policy(persist_steps=3, recur_count=10), [1, 2, 4, 5, 6])
    assert [d.severity for d in decisions] == ["warning", "warning", "warning", "warning", "error"]
    assert decisions[-1].reason == "anomaly on 3 consecutive checked steps"


def test_recurring_incidents_within_the_window_are_an_error():
    decisions = grades(policy(recur_count=3, recur_window=100), [10, 20, 30])
    assert [d.severity for d in decisions] == ["warning", "warning", "error"]
    assert decisions[-1].reason == "3 incidents within 100 steps"


@pytest.mark.parametrize("last, expected", [(109, "error"), (110, "warning")])
def test_the_window_holds_steps_strictly_less_than_window_apart(last, expected):
    decisions = grades(policy(recur_count=3, recur_window=100), [10, 20, last])
    assert decisions[-1].severity == expected


def test_persistence_is_named_before_recurrence_when_both_hold():
    decisions = grades(policy(persist_steps=2, recur_count=2), [5, 6])
    assert decisions[-1].reason == "anomaly on 2 consecutive checked steps"


def test_on_error_stop_stops_instead_of_rolling_back():
    decision = grades(policy(on_error="stop"), [1, 2])[-1]
    assert (decision.severity, decision.action) == ("error", "stop")


@pytest.mark.parametrize("replicas, expected", [(1, "warning"), (2, "critical"), (5, "critical")])
def test_origins_on_several_replicas_are_critical_from_the_first_incident(replicas, expected):
    decision = policy(critical_origins=2).grade(3, replicas, 0, True)
    assert decision.severity == expected
    if expected == "critical":
        assert decision.action == "stop" and decision.replay is False
        assert decision.reason == f"anomalies entered on {replicas} data-parallel replicas at once"


def test_a_critical_incident_still_counts_towards_the_next_grade():
    p = policy()
    assert p.grade(5, 2, 0, True).severity == "critical"
    assert p.grade(6, 1, 0, True).severity == "error"


@pytest.mark.parametrize("done, expected", [(0, "error"), (2, "error"), (3, "critical"), (4, "critical")])
def test_the_retry_budget_turns_an_error_into_a_critical_stop(done, expected):
    decision = grades(policy(recovery={"max_rollbacks": 3}), [1, 2], rollbacks_done=done)[-1]
    assert decision.severity == expected
    if expected == "critical":
        assert decision.action == "stop"
        assert decision.reason == ("anomaly on 2 consecutive checked steps; retry budget of 3 rollbacks spent")
    else:
        assert decision.action == "rollback"


def test_the_retry_budget_does_not_apply_when_errors_stop_anyway():
    decision = grades(policy(on_error="stop", recovery={"max_rollbacks": 1}), [1, 2], rollbacks_done=5)[-1]
    assert (decision.severity, decision.action) == ("error", "stop")


def test_a_single_anomaly_is_a_warning_even_with_the_budget_spent():
    assert policy(recovery={"max_rollbacks": 1}).grade(1, 1, 9, True).severity == "warning"


def test_reset_after_a_rollback_starts_a_new_episode():
    p = policy()
    assert [d.severity for d in grades(p, [1, 2])] == ["warning", "error"]
    p.reset()
    assert p.grade(3, 1, 1, True).severity == "warning"  # step 3 follows 2, but the episode is new
    assert p.grade(4, 1, 1, True).severity == "error"
