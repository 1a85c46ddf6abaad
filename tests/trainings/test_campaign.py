"""The fault campaign scored by harm (issue 55): the scorer's rules with negative controls
(scripts/campaign_score.py, no training), the quick campaign (a few cells on one rank and DP2,
branches of one clean warm-up, run by one branch server per layout: test_campaign_engine.py checks
it against a process per branch) scoring what docs/campaign_quick.jsonl says, the full file
(slow), and the table in docs/reliability.md generated from docs/campaign.jsonl."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import campaign_cells as cc  # noqa: E402
import campaign_score as cs  # noqa: E402
import fault_campaign as fc  # noqa: E402

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

BAND = {"loss": 1e-4, "weight": 1e-2, "runs": 5}
STATE = cc.Cell("inf", "element", "exp_avg_sq", "dp2")
FORWARD = cc.Cell("nan", "element", "forward", "dp2")


def _record(name=cc.PARAM, ranks=(0,), module=None, step=cc.FAULT_STEP):
    record = {"step": step, "kind": "nan", "first": {"name": name, "ranks": {"global": ranks[0]}},
              "origin_ranks": list(ranks)}
    if module is not None:
        record["forward_origin"] = {"module": module, "ranks": list(ranks)}
    return record


def _measure(**changes):
    m = {"finished": True, "stopped": None, "nonfinite_end": 0, "nonfinite_max": 0,
         "lr_factor_one": True, "twin_equal": True, "twin_distance": 0.0, "twin_loss_delta": 0.0,
         "incidents": [], "skipped": [], "loss_delta": 0.0, "distance": 0.0}
    return {**m, **changes}


def test_strict_localization_wants_the_exact_parameter_and_the_exact_rank_set():
    assert STATE.rank() == 0 and cs.localized(STATE, _record())  # the positive control
    module = cc.PARAM.rsplit(".", 1)[0]
    assert not cs.localized(STATE, _record(name=module))  # a record naming the module
    assert not cs.localized(STATE, _record(name="decoder.layers.1.mlp.linear_fc2.weight", module=module))
    assert not cs.localized(STATE, _record(ranks=(0, 1)))  # an extra rank
    assert not cs.localized(STATE, _record(ranks=(1,)))
    # A forward fault: the exact module, never its layer's parameter.
    assert cs.localized(FORWARD, _record(name="x", ranks=(1,), module=cc.MODULE))
    assert not cs.localized(FORWARD, _record(name=cc.PARAM, ranks=(1,)))
    assert not cs.localized(FORWARD, _record(name="x", ranks=(0, 1), module=cc.MODULE))
    # The activations detector names the module in the finding itself, with its activation reasons.
    flagged = _record(name=cc.MODULE, ranks=(1,))
    flagged["first"]["reasons"] = ["activation:rms"]
    assert cs.localized(FORWARD, flagged)
    flagged["first"]["reasons"] = ["zscore"]  # the same name from a gradient detector: not a forward name
    assert not cs.localized(FORWARD, flagged)
    flagged["first"].update(name="decoder.layers.1", reasons=["activation:rms"])  # its layer: not the module
    assert not cs.localized(FORWARD, flagged)


def test_a_finished_run_still_carrying_an_inf_or_off_its_twin_is_not_recovered():
    assert cs.recovered(_measure(), BAND)[0]  # the positive control: whole, bit-equal to its twin
    ok, why = cs.recovered(_measure(nonfinite_end=1, twin_equal=False), BAND)
    assert not ok and "non-finite" in why
    assert not cs.recovered(_measure(twin_equal=False, twin_distance=0.0), BAND)[0]  # a frozen weight
    assert not cs.recovered(_measure(finished=False, stopped="exit 85 at step 30"), BAND)[0]
    # A learning rate the guard changed: no twin holds it, the band decides.
    assert cs.recovered(_measure(lr_factor_one=False, twin_equal=False, twin_distance=5e-3, twin_loss_delta=5e-5),
                        BAND)[0]
    assert not cs.recovered(_measure(lr_factor_one=False, twin_equal=False, twin_distance=0.1, twin_loss_delta=0),
                            BAND)[0]


def test_harm_is_a_non_finite_state_a_stop_or_a_distance_beyond_the_band():
    assert cs.harm(_measure(loss_delta=5e-5, distance=5e-3), BAND)[1] is False
    assert cs.harm(_measure(loss_delta=5e-5, distance=5e-3, nonfinite_max=1), BAND)[1] is True
    assert cs.harm(_measure(loss_delta=2e-4, distance=5e-3), BAND)[1] is True
    assert cs.harm(_measure(loss_delta=0, distance=0.03), BAND)[1] is True
    assert cs.harm(_measure(stopped="exit 1 at step 30"), BAND)[1] is True
    assert cs.harm(_measure(loss_delta=None, distance=None), BAND)[1] is True
    figures, _ = cs.harm(_measure(loss_delta=1e-5, distance=2e-3, nonfinite_max=3), BAND)
    assert figures == {"loss_delta": 1e-5, "weight_distance": 2e-3, "band": {"loss": 1e-4, "weight": 1e-2},
                       "nonfinite": 3, "stopped": None}


def _row(cell, harmful, localized_defaults, localized_full):
    def config(found):
        return {"detected": found, "localized": found, "recovered": found, "false_positives": 0}
    return {"key": cell.key, "layout": cell.layout, "harmful": harmful,
            "defaults": config(localized_defaults), "full": config(localized_full)}


def test_a_harmless_cell_never_enters_the_denominator_and_both_configurations_share_it():
    cells = [cc.Cell("nan", "element", "grad", "1rank", s) for s in cc.SEEDS]
    rows = [_row(cells[0], True, True, True), _row(cells[1], True, False, True), _row(cells[2], False, True, True)]
    controls = [{"layout": "1rank", "config": c, "steps": 46, "incidents": int(c == "full")} for c in cc.CONFIGS
                for _ in range(30)]
    totals = cs.totals(rows, controls)
    for config, localized in (("defaults", 1), ("full", 2)):
        t = totals[f"1rank/{config}"]
        assert (t["harmful"], t["localized"], t["alarms_on_harmless"]) == (2, localized, 1)
    assert totals["1rank/defaults"]["misses"] == [cells[1].key] and totals["1rank/full"]["misses"] == []
    assert totals["1rank/full"]["clean_runs"] == 30 and totals["1rank/full"]["clean_steps"] == 30 * 46
    assert totals["1rank/full"]["false_positives_per_10k_clean_steps"] == round(30 * 1e4 / (30 * 46), 2)
    assert totals["1rank/defaults"]["false_positives_clean"] == 0


def test_the_score_takes_the_first_incident_from_the_fault_step_on():
    late = _record(step=cc.FAULT_STEP + 5)
    row = cs.score(STATE, _measure(incidents=[_record(step=cc.FAULT_STEP - 1), late]), BAND)
    assert row["detected"] and row["steps_to_detect"] == 5 and row["localized"]
    assert cs.score(STATE, _measure(), BAND)["detected"] is False


def test_each_cell_makes_a_drill_the_parser_takes():
    from megatron_patches.inject import parse_spec

    for cell in cc.cells(tuple(cc.LAYOUTS)):
        spec = parse_spec(cell.spec())
        assert (spec.step, spec.scope, spec.seed, spec.rank) == (cc.FAULT_STEP, cell.scope, cell.seed, cell.rank())


SCORES = ("detected", "localized", "recovered", "false_positives")


def _compare(rows: list, tail: dict, claimed_path: Path) -> None:
    claimed_rows, claimed_tail = fc.read_jsonl(claimed_path)
    claimed = {r["key"]: r for r in claimed_rows}
    got = {r["key"]: r for r in rows}
    assert sorted(got) == sorted(claimed)
    differ = {key: {what: (claimed[key][c][what], got[key][c][what]) for c in cc.CONFIGS for what in SCORES
                    if claimed[key][c][what] != got[key][c][what]} for key in got}
    differ.update({key: {"harmful": (claimed[key]["harmful"], got[key]["harmful"])} for key in got
                   if claimed[key]["harmful"] != got[key]["harmful"]})
    assert {k: v for k, v in differ.items() if v} == {}, f"cells scoring other than {claimed_path.name} says"
    assert tail["totals"] == claimed_tail["totals"]


@pytest.mark.multiproc
def test_the_quick_campaign_scores_what_its_file_says(tmp_path):
    rows, tail = fc.campaign(cc.cells(quick=True), tmp_path, controls=1, progress=lambda line: None,
                             nudges=fc.QUICK_NUDGES)
    _compare(rows, tail, REPO / "docs" / "campaign_quick.jsonl")
    totals = tail["totals"]
    # Issue 55's two DP2 cells, harmful: the defaults' held-state check (issue 56) finds, names and
    # recovers both, the Inf in exp_avg_sq and exp_avg x1000 of the whole tensor (judged against the
    # baselines the branch's snapshot carries); the audit catches and rolls back both too.
    assert (totals["dp2/defaults"]["harmful"], totals["dp2/defaults"]["localized"]) == (2, 2)
    assert totals["dp2/defaults"]["misses"] == [] and totals["dp2/defaults"]["recovered"] == 2
    assert (totals["dp2/full"]["localized"], totals["dp2/full"]["recovered"]) == (2, 2)
    # A harmless cell (one ulp of every weight of the parameter) is outside every denominator.
    assert totals["1rank/defaults"]["harmless"] == 1 and totals["1rank/defaults"]["harmful"] == 3
    assert all(m["warmups_bit_equal"] and all(m["guarded_clean_twin_bit_equal_to_unguarded"].values())
               for m in tail["meta"]["layouts"].values())


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_full_campaign_scores_what_docs_campaign_jsonl_says(tmp_path):
    claimed_rows, claimed_tail = fc.read_jsonl(fc.JSONL)
    meta = claimed_tail["meta"]
    keys = {r["key"] for r in claimed_rows}
    cells = [c for c in cc.cells(tuple(meta["layouts"]), seeds=tuple(meta["seeds"])) if c.key in keys]
    rows, tail = fc.campaign(cells, tmp_path, controls=meta["controls_per_data_kind"], progress=lambda line: None,
                             nudges=tuple(meta["nudges"]))
    _compare(rows, tail, fc.JSONL)


def test_the_table_in_reliability_md_is_the_one_generated_from_campaign_jsonl():
    rows, tail = fc.read_jsonl(fc.JSONL)
    text = (REPO / "docs" / "reliability.md").read_text()
    section = text.split(fc.BEGIN, 1)[1].split(fc.END, 1)[0]
    assert section == "\n" + fc.markdown(rows, tail), "the table is stale: run scripts/fault_campaign.py --write-docs"


@pytest.mark.parametrize("argv, named", [(["--branch-nudge", "sideways", "--branch-from", "x"], "'sideways'"),
                                         (["--branch-nudge", "up"], "with --branch-from"),
                                         (["--branch-skip", "26,x"], "'26,x'"),
                                         (["--branch-blacklist", "a"], "'a'")])
def test_a_wrong_branch_flag_is_one_line_naming_the_value(argv, named):
    from megatron_patches.errors import UserError
    from megatron_patches.testing.tiny_gpt import parse_args

    with pytest.raises(UserError, match=named):
        parse_args(argv)
    assert parse_args(["--branch-skip", "26, 27", "--branch-blacklist", "3"]).branch_skip == frozenset({26, 27})
