"""The fault campaign (issue 40): its quick mode, one fault per kind x target on one rank and on
DP2 (bf16, distributed optimizer), and per kind x weight or state target on DP2 with every
detector on, scores what docs/campaign_quick.json says, cell by cell; the
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
# behind docs/campaign.json and not in the next one. Their cause, found 2026-12-06: the faults before
# them that the guard neither skipped nor rolled back, still in the weights (with step 373's fault
# dropped they came again, with no fault at all they did not, and neither half of the earlier faults
# alone brought them); such a cell is now scored again in a training of its own (fault_campaign.alone).
VARIES = {"1rank/exp_avg/element/inf", "1rank/exp_avg/element/bitflip:mantissa_high",
          "1rank/exp_avg/element/scale:x1000", "1rank/exp_avg/all/bitflip:exponent_high",
          # docs/reliability.md, "A rollback that repeats itself": a zscore every redo met again at the same
          # step (988 rollbacks in two runs, now a stop at the second); its false positives may vary.
          "tp2/exp_avg/10pct/noise:1%", "tp2/exp_avg/all/nan"}


def _compare(rows: list, claimed_path: Path, varies: frozenset = frozenset()) -> None:
    got = {row["key"]: row for row in rows}
    ran = {row["layout"] for row in rows}
    claimed = {row["key"]: row for row in json.loads(claimed_path.read_text())["rows"] if row["layout"] in ran}
    assert sorted(got) == sorted(claimed)
    differ = {key: {s: (claimed[key][s], got[key][s]) for s in SCORES if claimed[key][s] != got[key][s]}
              for key in got if key not in varies}
    differ = {key: what for key, what in differ.items() if what}
    assert differ == {}, f"cells scoring other than {claimed_path.name} says (claimed, got): {differ}"
    if not varies:
        assert cc.totals(rows) == {layout: t for layout, t in json.loads(claimed_path.read_text())["totals"].items()
                                   if layout in ran}


@pytest.mark.multiproc
def test_the_quick_campaign_scores_what_the_docs_claim(tmp_path):
    rows = fc.campaign(cc.cells(quick=True), tmp_path, per_run=60, quiet=True)
    _compare(rows, REPO / "docs" / "campaign_quick.json")
    totals = cc.totals(rows)
    assert all(t["false_positives"] == 0 for t in totals.values()), totals


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_full_campaign_scores_what_the_docs_claim(tmp_path):
    layouts = tuple(layout for layout in cc.LAYOUTS if fc.runnable(layout))  # EP2, CP2: the 3.12 leg
    rows = fc.campaign(cc.cells(layouts=layouts), tmp_path, per_run=60, quiet=True)
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


def _direction_against_momentum(out: Path, *args: str) -> list:
    """Train unguarded; per update after the first 20, the cosine between layer 1's fc1 gradient
    and its Adam momentum (``exp_avg``) right before the update (what a sign flip would reverse)."""
    import torch
    import torch.optim.optimizer as optim

    from conftest import run_forked
    from megatron_patches.testing import tiny_gpt

    found = out / "cosines.json"

    def train():
        cosines = []

        def before_step(optimizer, args, kwargs):
            fc1 = [p for group in optimizer.param_groups for p in group["params"] if tuple(p.shape) == (256, 64)]
            state = optimizer.state.get(fc1[1], {}) if len(fc1) == 2 else {}
            if fc1 and fc1[1].grad is not None and "exp_avg" in state:
                grad, momentum = fc1[1].grad.float().flatten(), state["exp_avg"].float().flatten()
                cosines.append(float(grad @ momentum / (grad.norm() * momentum.norm()).clamp_min(1e-30)))

        optim.register_optimizer_step_pre_hook(before_step)
        try:
            return tiny_gpt.main(["--out", str(out), "--no-guard", *args])
        finally:
            found.write_text(json.dumps(cosines[20:]))

    code, output = run_forked(train)
    assert code == 0, output[-3000:]
    return json.loads(found.read_text())


TEXT = ["--data", f"text:{Path(json.__file__).parent.parent}", "--data-max-mib", "4",
        "--vocab", "320"]  # byte tokens; a vocabulary not 256 keeps the embedding's shape apart from fc1's


@pytest.mark.parametrize("data", [[], TEXT], ids=["synthetic", "text"])
def test_a_whole_gradient_with_its_sign_flipped_is_what_a_clean_step_looks_like(tmp_path, data):
    """The argument behind the whole-tensor sign cells of `local` and `grad` (REASONS): on clean
    steps the gradient points against its momentum about half of the time, so a reversed gradient
    stands out in no statistic of the tensor (norms are sign-blind)."""
    cosines = _direction_against_momentum(tmp_path, "--steps", "150", "--precision", "bf16", *data)
    against = sum(c < 0 for c in cosines) / len(cosines)
    print(f"{len(cosines)} updates: against the momentum on {against:.0%}, cosine {min(cosines):.2f} to {max(cosines):.2f}")
    assert len(cosines) >= 100 and 0.3 <= against <= 0.9


def test_each_cell_makes_a_drill_the_parser_takes():
    from megatron_patches.inject import parse_spec

    for cell in cc.cells():
        spec = parse_spec(cell.spec(cc.fault_step(3)))
        assert (spec.step, spec.scope, spec.seed, spec.rank) == (cc.fault_step(3), cell.scope, cc.SEED, cell.rank())


def _mlp_outputs(out: Path, *args: str) -> dict:
    """Train unguarded for 200 steps; over the last three quarters of layer 1's MLP outputs (one per
    micro-batch): the mean over the RMS, the share of positive values, and the ratio of the norm of
    each output's per-channel means (over the tokens) to the previous micro-batch's."""
    import torch

    from conftest import run_forked
    from megatron_patches.testing import tiny_gpt

    found = out / "outputs.json"

    def train():
        seen = []

        def hook(module, args, output):
            if type(module).__name__ == "MLP":
                value = (output[0] if isinstance(output, tuple) else output).detach().float()
                channels = value.reshape(-1, value.shape[-1]).mean(0)
                seen.append((float(value.mean() / value.square().mean().sqrt()), float((value > 0).float().mean()),
                             float(channels.norm())))

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            return tiny_gpt.main(["--out", str(out), "--no-guard", "--steps", "200", "--precision", "bf16", *args])
        finally:
            handle.remove()
            layer1 = seen[1::2][len(seen[1::2]) // 4:]  # two layers: every second MLP call is layer 1's
            found.write_text(json.dumps({"mean_over_rms": [m for m, _, _ in layer1],
                                         "positive": [p for _, p, _ in layer1],
                                         "ratio": [b / a for (_, _, a), (_, _, b) in zip(layer1, layer1[1:])]}))

    code, output = run_forked(train)
    assert code == 0, output[-3000:]
    return json.loads(found.read_text())


def test_an_activation_with_a_share_of_its_signs_flipped_is_what_a_clean_output_looks_like(tmp_path):
    """The argument behind the forward sign cells of 1 % and 10 % (REASONS): an MLP output's values lie
    evenly about zero, so negating a random share of them changes no magnitude or shape statistic;
    what it changes, the per-channel means, shrinks by 2 % or 20 %, less than it moves from one
    micro-batch to the next."""
    seen = _mlp_outputs(tmp_path)
    print({key: (round(min(v), 3), round(max(v), 3)) for key, v in seen.items()})
    assert max(abs(m) for m in seen["mean_over_rms"]) < 0.05
    assert 0.45 < min(seen["positive"]) and max(seen["positive"]) < 0.55
    assert min(seen["ratio"]) < 0.8 and max(seen["ratio"]) > 1.25


def _stand_in_runner(incidents_of, calls: list):
    """A runner that trains nothing (the campaign's bookkeeping under test): every step logs loss
    1.0, and the records are what ``incidents_of(drills)`` gives."""
    def runner(out, layout, steps, config, drills, lasting):
        calls.append((out.name, steps, list(drills)))
        out.mkdir(parents=True, exist_ok=True)
        (out / "incidents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in incidents_of(drills)))
        return 0, "".join(f"step {s:>4}/{steps} | loss 1.0000 | grad-norm 1\n" for s in range(1, steps + 1))
    return runner


def test_a_cell_with_incidents_its_fault_should_not_make_after_earlier_faults_is_scored_again_alone(tmp_path):
    """A training carries many cells; where the second cell's controls had an incident, and where
    the third, argued undetectable, had one in its window, each is trained again with its fault
    alone at the same step, that run gives its row, and the grouped score is kept under ``grouped``.
    The first cell's controls (no fault before it) are its own."""
    cells = [cc.Cell("nan", "element", "param", "1rank"), cc.Cell("scale:x2", "element", "param", "1rank"),
             cc.Cell("bitflip:mantissa_low", "element", "param", "1rank")]
    assert [bool(cell.reason()) for cell in cells] == [False, False, True]
    at = [cc.fault_step(index) for index in range(3)]
    found = {"kind": "nan", "first": {"name": cc.PARAM, "ranks": {"global": 0}}}
    other = {"kind": "peers", "first": {"name": "decoder.layers.0.mlp.linear_fc2.bias", "ranks": {"global": 0}}}
    grouped = [{"step": at[0], **found}, {"step": at[0] + cc.DETECT + 1, **found}, {"step": at[1] + cc.DETECT + 1, **found},
               {"step": at[2], **other}]
    calls: list = []
    rows = fc.campaign(cells, tmp_path, per_run=60, quiet=True,
                       runner=_stand_in_runner(lambda drills: grouped if len(drills) == 3 else [], calls))
    assert [c[2] for c in calls] == [[cell.spec(step) for cell, step in zip(cells, at)], [cells[1].spec(at[1])],
                                     [cells[2].spec(at[2])]]
    assert calls[1][1] == at[1] + cc.GAP - 1  # the alone run ends where the cell's controls end
    assert rows[0]["localized"] and rows[0]["false_positives"] == 1 and "grouped" not in rows[0]
    assert rows[1]["false_positives"] == 0 and rows[1]["run"].endswith("-alone")
    assert rows[1]["grouped"] == {"run": calls[0][0], "detected": False, "localized": False, "false_positives": 1,
                                  "recovered": True}
    assert not rows[2]["detected"] and rows[2]["grouped"]["detected"]


def test_the_forward_origin_narrows_the_origin_ranks_only_when_it_is_a_part_of_them():
    """EP2: the all-to-all carries a forward fault to both ranks within the step, so both gradients
    go non-finite; the rerun's forward origin is the rank it entered. DP2, a state fault on rank 0's
    shard: the gathered weight makes both forward passes go off; the origin is rank 0's held state."""
    assert cc.reported_ranks({"origin_ranks": [0, 1], "forward_origin": {"ranks": [1]}}) == [1]
    assert cc.reported_ranks({"origin_ranks": [0], "forward_origin": {"ranks": [0, 1]}}) == [0]
    assert cc.reported_ranks({"origin_ranks": [1], "forward_origin": {"ranks": [1]}, "suspected_ranks": [0]}) == [0]
    assert cc.reported_ranks({"forward_origin": {"ranks": [1]}}) == [1]
