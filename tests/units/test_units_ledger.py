"""The rollback ledger without training: what it keeps across restarts, how a rollback is
counted, and which fields it refuses (ledger.Ledger). tests/trainings/test_ledger.py loads hostile
files end to end; these pin the arithmetic and the messages."""

import json
import math
import os

import pytest

from megatron_patches.config import Config
from megatron_patches.errors import UserError
from megatron_patches.ledger import LEDGER_FILE, LEDGER_SCHEMA, Ledger, _ledger_problem
from megatron_patches.decisions import GradePolicy

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


def recovery(**fields):
    return Config.from_dict({"recovery": fields}).recovery


def test_no_ledger_file_is_a_fresh_ledger(tmp_path):
    ledger = Ledger.load(str(tmp_path / "nothing_here"))
    assert ledger == Ledger()
    assert (ledger.blacklist, ledger.rollbacks, ledger.lr_scale, ledger.rollback_requested) == ([], 0, 1.0, None)


def test_every_field_survives_a_save_and_load(tmp_path):
    root = str(tmp_path / "ckpt" / "deeper")  # save makes the directories
    ledger = Ledger(blacklist=[2, 9], rollbacks=2, lr_scale=0.25, disabled_features=["fused_attn"],
                    spent_injections=["nan:step=3"], rollback_requested={"from_step": 12},
                    events=[{"step": 12, "exit": 84, "lr_scale": 0.25}])
    ledger.save(root)
    assert Ledger.load(root) == ledger
    with open(os.path.join(root, LEDGER_FILE), encoding="utf-8") as handle:
        text = handle.read()
    on_disk = json.loads(text)
    assert next(iter(on_disk)) == "schema" and on_disk["schema"] == LEDGER_SCHEMA
    assert "\n" in text  # indented: a person can read and repair it
    assert os.listdir(root) == [LEDGER_FILE]


def test_a_second_save_replaces_the_first(tmp_path):
    Ledger(rollbacks=1).save(str(tmp_path))
    Ledger(rollbacks=2, blacklist=[5]).save(str(tmp_path))
    again = Ledger.load(str(tmp_path))
    assert (again.rollbacks, again.blacklist) == (2, [5])


def test_save_into_a_path_that_is_a_file_raises_oserror(tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(OSError):
        Ledger().save(str(blocked))


def test_record_rollback_counts_blacklists_and_scales_the_learning_rate():
    ledger = Ledger(blacklist=[7])
    new = ledger.record_rollback(recovery(lr_factor=0.5, lr_floor=0.05, disable_features=["dropout", "fusions"]),
                                 [9, 7, 3])
    assert ledger.blacklist == [3, 7, 9] and ledger.rollbacks == 1 and ledger.lr_scale == 0.5
    assert new == ["dropout", "fusions"] and ledger.disabled_features == ["dropout", "fusions"]
    assert ledger.record_rollback(recovery(lr_factor=0.5, disable_features=["dropout", "fusions"]), []) == []
    assert ledger.rollbacks == 2 and ledger.lr_scale == 0.25 and ledger.disabled_features == ["dropout", "fusions"]


def test_the_learning_rate_scale_stops_at_the_floor():
    ledger = Ledger()
    scales = []
    for _ in range(4):
        ledger.record_rollback(recovery(lr_factor=0.5, lr_floor=0.3), [])
        scales.append(ledger.lr_scale)
    assert scales == [0.5, 0.3, 0.3, 0.3]


def test_rollbacks_counted_in_the_ledger_spend_the_grading_budget(tmp_path):
    config = Config.from_dict({"recovery": {"max_rollbacks": 2}})
    ledger = Ledger()
    severities = []
    for episode in range(3):
        policy = GradePolicy(config)  # a restarted job grades afresh, but reads the count back
        policy.grade(10 * episode + 1, 1, ledger.rollbacks, True)
        decision = policy.grade(10 * episode + 2, 1, ledger.rollbacks, True)
        severities.append((decision.severity, decision.action))
        if decision.action == "rollback":
            ledger.record_rollback(config.recovery, [])
            ledger.save(str(tmp_path))
            ledger = Ledger.load(str(tmp_path))
    assert severities == [("error", "rollback"), ("error", "rollback"), ("critical", "stop")]
    assert ledger.rollbacks == 2


HARDWARE = '`hardware` must be a list of {"host": string, "device": string, "rank": integer >= 0, "step": integer >= 0}, '
FENCED = '`fenced` must be null or {"host", "device", "rank", "step", "incidents" >= 1}, '


@pytest.mark.parametrize("data, message", [
    ({}, None),
    ({"blacklist": [0, 4], "rollbacks": 0, "lr_scale": 1, "events": [], "rollback_requested": None}, None),
    ({"rolbacks": 1}, "unknown field `rolbacks` (valid: blacklist, disabled_features, disqualified, events, fenced, "
                      "hardware, lr_scale, rollback_requested, rollbacks, spent_injections)"),
    ({"blacklist": [1, True]}, "`blacklist` must be a list of non-negative integers (sample indices), got [1, true]"),
    ({"rollbacks": -1}, "`rollbacks` must be a non-negative integer, got -1"),
    ({"lr_scale": 1.5}, "`lr_scale` must be a finite number in (0, 1], got 1.5"),
    ({"lr_scale": True}, "`lr_scale` must be a finite number in (0, 1], got true"),
    ({"disabled_features": ["a", 1]}, "`disabled_features` must be a list of strings, got [\"a\", 1]"),
    ({"spent_injections": "nan:step=1"}, "`spent_injections` must be a list of strings, got \"nan:step=1\""),
    ({"rollback_requested": 5}, "`rollback_requested` must be an object or null, got 5"),
    ({"events": [{"step": 1}, 2]}, "`events` must be a list of objects, got [{\"step\": 1}, 2]"),
    ({"events": [{"a": [1, {"b": math.inf}]}]}, "`events[0].a[1].b` must be a finite number, got inf"),
    ({"rollback_requested": {"from_step": math.nan}}, "`rollback_requested.from_step` must be a finite number, got nan"),
    # A device's hardware-class incidents, the device fenced, the targets disqualified (cause_response).
    ({"hardware": [{"host": "n1", "device": "cuda:3", "rank": 3, "step": 7}], "disqualified": [4],
      "fenced": {"host": "n1", "device": "cuda:3", "rank": 3, "step": 7, "incidents": 2}}, None),
    ({"hardware": [{"host": "n1", "device": "d", "rank": 3}]}, HARDWARE + 'got [{"host": "n1", "device": "d", "rank": 3}]'),
    ({"hardware": [{"host": 1, "device": "d", "rank": 3, "step": 7}]},
     HARDWARE + 'got [{"host": 1, "device": "d", "rank": 3, "step": 7}]'),
    ({"hardware": [{"host": "n", "device": "d", "rank": -1, "step": 7}]},
     HARDWARE + 'got [{"host": "n", "device": "d", "rank": -1, "step": 7}]'),
    ({"hardware": [{"host": "n", "device": "d", "rank": 1, "step": 7, "x": 1}]},
     HARDWARE + 'got [{"host": "n", "device": "d", "rank": 1, "step": 7, "x": 1}]'),
    ({"fenced": {"host": "n", "device": "d", "rank": 3, "step": 7, "incidents": 0}},
     FENCED + 'got {"host": "n", "device": "d", "rank": 3, "step": 7, "incidents": 0}'),
    ({"fenced": "n1"}, FENCED + 'got "n1"'),
    ({"disqualified": [4, True]}, "`disqualified` must be a list of non-negative integers (checkpoint steps), got [4, true]"),
])
def test_ledger_problem_names_the_field_and_what_it_must_be(data, message):
    assert _ledger_problem(data) == message


def test_a_long_bad_value_is_cut_in_the_message():
    problem = _ledger_problem({"blacklist": list(range(-1, 200))})
    assert problem.startswith("`blacklist` must be a list of non-negative integers") and len(problem) < 200


@pytest.mark.parametrize("content, said", [
    (b'{"schema": "megatron_patches.ledger/1", "rollbacks": 2', "cannot be read as JSON"),
    (b"", "cannot be read as JSON"),
    (b'{"rollbacks": 2}', "is not a megatron_patches ledger (schema None, expected 'megatron_patches.ledger/1')"),
    (b'"text"', "is not a megatron_patches ledger (schema 'str'"),
    (b'{"schema": "megatron_patches.ledger/1", "lr_scale": 0}', "`lr_scale` must be a finite number in (0, 1]"),
])
def test_a_partial_or_foreign_ledger_is_never_applied(tmp_path, content, said):
    (tmp_path / LEDGER_FILE).write_bytes(content)
    with pytest.raises(UserError) as caught:
        Ledger.load(str(tmp_path))
    message = str(caught.value)
    assert message.startswith(f"ledger {tmp_path / LEDGER_FILE}") and said in message
    assert message.endswith("(its blacklist and rollback count are lost)")


def test_a_directory_where_the_ledger_should_be_is_refused(tmp_path):
    (tmp_path / LEDGER_FILE).mkdir()
    with pytest.raises(UserError, match="cannot be read as JSON"):
        Ledger.load(str(tmp_path))


def test_safe_mode_grows_by_one_list_on_each_further_rollback():
    settings = recovery(disable_features=["dropout"], disable_on_further_rollbacks=[["fusions"], ["overlap", "dropout"]])
    ledger = Ledger()
    assert [ledger.record_rollback(settings, []) for _ in range(4)] == [["dropout"], ["fusions"], ["overlap"], []]
    assert ledger.disabled_features == ["dropout", "fusions", "overlap"]


def test_a_rollback_from_the_same_step_that_changes_nothing_would_repeat_the_last():
    """The redo of a rollback that changes nothing (no new sample, the same learning-rate scale, no
    feature switched off, the same iterations left out) computes what the last redo did."""
    flat = recovery(lr_factor=1.0)
    ledger = Ledger(blacklist=[5])
    assert not ledger.would_repeat(flat, 12, [])  # no rollback yet
    ledger.record_rollback(flat, [])
    ledger.events.append({"step": 12, "rolled_back_to": 8, "skip_iterations": [11]})
    assert ledger.would_repeat(flat, 12, [5], skipped=[11])  # 5 is blacklisted already
    assert not ledger.would_repeat(flat, 13, [], skipped=[11])  # the redo got past step 12
    assert not ledger.would_repeat(flat, 12, [6], skipped=[11])  # a new sample leaves the batch out
    ledger.events[-1]["blacklisted"] = 8  # ... unless the last redo fed other samples and met it anyway
    assert ledger.would_repeat(flat, 12, [6], skipped=[11])
    ledger.events[-1]["blacklisted"] = 0
    assert not ledger.would_repeat(flat, 12, [], skipped=[])  # other iterations left out
    assert not ledger.would_repeat(recovery(lr_factor=0.5), 12, [], skipped=[11])  # a lower learning rate
    assert not ledger.would_repeat(recovery(lr_factor=1.0, disable_features=["dropout"]), 12, [], skipped=[11])
    ledger.lr_scale = 0.3
    assert ledger.would_repeat(recovery(lr_factor=0.5, lr_floor=0.3), 12, [], skipped=[11])  # at the floor


def test_an_unknown_name_in_a_later_list_is_refused():
    from megatron_patches.errors import ConfigError

    with pytest.raises(ConfigError, match="disable_on_further_rollbacks` names no feature the guard can switch off "
                                          r"\(fp8\)"):
        recovery(disable_on_further_rollbacks=[["fusions"], ["fp8"]])
