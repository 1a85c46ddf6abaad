"""The fault campaign (issue 40): its quick mode, one fault per kind x target on one rank and on
DP2 (bf16, distributed optimizer), and per kind x weight or state target on DP2 with the state
audit, scores what docs/campaign_quick.json says, cell by cell; the
full campaign what docs/campaign.json says (slow); and the table in docs/reliability.md is the one
scripts/fault_campaign.py generates from docs/campaign.json."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import campaign_cells as cc  # noqa: E402
import fault_campaign as fc  # noqa: E402

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

SCORES = ("detected", "localized", "false_positives", "recovered", "steps_to_detect")


# Seen to score differently between two runs of the same code: the one-rank training of the weight and
# state faults (27 rollbacks by step 379) met peers false positives on layer 0's fc2 bias in the run
# behind docs/campaign.json and not in the next one (docs/reliability.md, hole 10; cause not found).
VARIES = {"1rank/exp_avg/element/inf", "1rank/exp_avg/element/bitflip:mantissa_high",
          "1rank/exp_avg/element/scale:x1000", "1rank/exp_avg/all/bitflip:exponent_high",
          # Run once (docs/reliability.md, "A rollback that repeats itself"): a zscore the redo meets again
          # at the same step, 988 rollbacks until the campaign's budget of 1000; not yet seen twice.
          "tp2/exp_avg/10pct/noise:1%", "tp2/exp_avg/all/nan"}


def _compare(rows: list, claimed_path: Path, varies: frozenset = frozenset()) -> None:
    claimed = {row["key"]: row for row in json.loads(claimed_path.read_text())["rows"]}
    got = {row["key"]: row for row in rows}
    assert sorted(got) == sorted(claimed)
    differ = {key: {s: (claimed[key][s], got[key][s]) for s in SCORES if claimed[key][s] != got[key][s]}
              for key in got if key not in varies}
    differ = {key: what for key, what in differ.items() if what}
    assert differ == {}, f"cells scoring other than {claimed_path.name} says (claimed, got): {differ}"
    if not varies:
        assert cc.totals(rows) == json.loads(claimed_path.read_text())["totals"]


@pytest.mark.multiproc
def test_the_quick_campaign_scores_what_the_docs_claim(tmp_path):
    rows = fc.campaign(cc.cells(quick=True), tmp_path, per_run=60, quiet=True)
    _compare(rows, REPO / "docs" / "campaign_quick.json")
    totals = cc.totals(rows)
    assert all(t["false_positives"] == 0 for t in totals.values()), totals


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_full_campaign_scores_what_the_docs_claim(tmp_path):
    rows = fc.campaign(cc.cells(), tmp_path, per_run=60, quiet=True)
    _compare(rows, REPO / "docs" / "campaign.json", frozenset(VARIES))


def test_the_table_in_reliability_md_is_the_one_generated_from_campaign_json():
    result = json.loads((REPO / "docs" / "campaign.json").read_text())
    text = (REPO / "docs" / "reliability.md").read_text()
    section = text.split(fc.BEGIN, 1)[1].split(fc.END, 1)[0]
    regenerate = "scripts/fault_campaign.py --from-json docs/campaign.json --write-docs"
    assert section == "\n" + fc.markdown(result), f"the table is stale: run {regenerate}"


def test_every_undetectable_cell_has_a_reason_and_every_reason_names_a_cell_of_the_menu():
    for (kind, target), (scopes, why) in cc.REASONS.items():
        assert kind in cc.KINDS and target in cc.TARGETS and set(scopes) <= set(cc.SCOPES), (kind, target)
        assert len(why) > 60, (kind, target)  # an argument, not a shrug
    rows = json.loads((REPO / "docs" / "campaign.json").read_text())["rows"]
    # Found and named: the argument would be wrong. (Found with another tensor named is an incident that
    # happened to fall in the window; the table shows it as `d`.)
    argued_but_caught = [r["key"] for r in rows if r["reason"] and r["localized"]]
    assert argued_but_caught == [], f"argued undetectable, yet detected and named: {argued_but_caught}"


def test_each_cell_makes_a_drill_the_parser_takes():
    from megatron_patches.inject import parse_spec

    for cell in cc.cells():
        spec = parse_spec(cell.spec(cc.fault_step(3)))
        assert (spec.step, spec.scope, spec.seed, spec.rank) == (cc.fault_step(3), cell.scope, cc.SEED, cell.rank())
