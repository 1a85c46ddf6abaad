"""Rank 0's decision on an incident without ranks: decide.decide over hand-made RankReports
(what the gather would bring), the policy and the step's facts. No process group, no training:
ties for "the first parameter", two origins, an expert-parallel group, ranks that did not report,
and the guard's own failure while deciding."""

import pickle

import pytest
import torch

from megatron_patches.check import Verdict
from megatron_patches.config import Config
from megatron_patches.decide import StepFacts, decide
from megatron_patches.decisions import Action, GradePolicy
from megatron_patches.detectors import CheckContext
from megatron_patches.findings import RankReport
from megatron_patches.incidents import ParamFinding, first_of
from megatron_patches.respond import Responder

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

WORLD = {"size": 4, "tp": 1, "pp": 1, "dp": 4, "cp": 1, "ep": 1}
OUTPUT, FC1 = "output_layer.weight", "decoder.layers.1.mlp.linear_fc1.weight"


def ranks(rank, dp=None, ep=0, edp=None, tp=0):
    dp = rank if dp is None else dp
    return {"global": rank, "tp": tp, "pp": 0, "dp": dp, "cp": 0, "ep": ep, "edp": dp if edp is None else edp, "vpp": 0}


def finding(name, order, rank, nan=3, layer=None, **where):
    return ParamFinding(name=name, layer=layer, shape=[4, 4], nan=nan, inf=0, overflow=0, norm=None,
                        ranks=ranks(rank, **where), host=f"host{rank}", device=f"cpu:{rank}", order=order,
                        reasons=["nan"] if nan else ["magnitude"])


def verdict(step=5, total_norm=float("nan")):
    ctx = CheckContext(step=step, entries=[], grads=[], norms=None, device=torch.device("cpu"), total_norm=total_norm)
    return Verdict(ctx=ctx, maxabs=None, total_over=False, kinds=[], reduced={}, layer_sq=[], flagged=True)


def policy(**response):
    return GradePolicy(Config.from_dict({"response": response}))


def facts(**changes):
    return StepFacts(**{"checked": 100, "world": WORLD, **changes})


def test_a_tie_goes_to_the_lowest_rank_everywhere_the_first_parameter_is_named():
    """The same parameter on two ranks (tensor-parallel shards): whatever order the reports come
    in, the message, the record's ``first`` and ``params`` and ``first_name`` agree on rank 0."""
    reports = [RankReport(ranks=ranks(1, dp=0, tp=1), findings=(finding(OUTPUT, 40, 1, dp=0, tp=1),)),
               RankReport(ranks=ranks(0, dp=0), findings=(finding(OUTPUT, 40, 0, dp=0), finding(FC1, 12, 0, layer=1)))]
    decision, incident = decide(verdict(), reports, policy(), facts())
    record = incident.record()
    assert (decision.severity, decision.action) == ("warning", "skip_step")
    assert incident.first_name == OUTPUT and record["first"]["ranks"]["global"] == 0
    assert [(p["name"], p["ranks"]["global"]) for p in record["params"]] == [(OUTPUT, 0), (OUTPUT, 1), (FC1, 0)]
    assert incident.message.startswith(f"nan gradient first at {OUTPUT} (layer None, rank 0); 2 parameter(s)")
    assert record["ranks_affected"] == [0, 1]


def test_unnamed_parameters_tie_on_their_order_and_the_one_listed_first_leads():
    a, b = finding("<unnamed (4, 4)>", -1, 0), finding("<unnamed (2,)>", -1, 0)
    assert first_of([a, b]) is a and first_of([b, a]) is b and first_of([]) is None


def test_two_origins_in_two_replicas_are_a_critical_stop_naming_both():
    reports = [RankReport(ranks=ranks(r), findings=(finding(FC1, 12, r, layer=1),), origin=True,
                          pre_reduction=(finding(FC1, 12, r, layer=1),), batch=(10 * r, 10 * r + 1)) for r in (1, 2)]
    decision, incident = decide(verdict(), reports, policy(), facts())
    assert (decision.severity, decision.action, decision.origins) == ("critical", "stop", (1, 2))
    assert "entered on 2 data-parallel replicas" in decision.reason
    record = incident.record()
    assert record["origin_ranks"] == [1, 2] and record["replicas_reached"] == 2
    assert record["first"]["ranks"]["global"] == 1 and record["batch"]["samples"] == [10, 11, 20, 21]
    assert "entered on rank(s) [1, 2] before the data-parallel reduction, reached 2 of 4" in incident.message


def test_a_corruption_one_rank_holds_is_the_origin_though_every_replica_went_non_finite():
    """Under the distributed optimizer rank 2's NaN in its shard of fc1's weights reaches every
    replica through the all-gather: the gradients of ranks 1 and 2 are non-finite before the
    reduction, but rank 2 holds the corruption. One origin: graded as any single fault (a skip
    first; it lasts, so the next flagged step rolls back), named where it is held."""
    held = ParamFinding(name=FC1, layer=1, shape=[4, 4], nan=1, inf=0, overflow=0, norm=None, ranks=ranks(2),
                        host="host2", device="cpu:2", order=12, shard=True, reasons=["held:weight", "held:exp_avg"])
    reports = [RankReport(ranks=ranks(r), findings=(finding(OUTPUT, 40, r),), origin=True,
                          pre_reduction=(finding(OUTPUT, 40, r),), held=(held,) if r == 2 else ()) for r in (1, 2)]
    decision, incident = decide(verdict(), reports, policy(), facts())
    assert (decision.severity, decision.action, decision.origins) == ("warning", "skip_step", (2,))
    record = incident.record()
    assert record["origin_ranks"] == [2] and record["first"]["name"] == FC1 and record["first"]["ranks"]["global"] == 2
    assert incident.message.startswith(f"non-finite weight and exp_avg first at {FC1} (layer 1, rank 2, host host2")
    assert "held in the weights or optimizer state of rank(s) [2]" in incident.message
    assert record["held_nonfinite"][0]["reasons"] == ["held:weight", "held:exp_avg"]
    # Its cause, before any replay: hardware on rank 2's device, the signs travelling with the decision.
    assert decision.signs.held_ranks == (2,) and decision.signs.origin_replicas == 1
    assert record["cause"] == {"class": "hardware", "confidence": "high", "devices": [
        {"rank": 2, "host": "host2", "device": "cpu:2"}], "evidence": [
        "non-finite values in the weights or optimizer state held on rank(s) 2",
        "every gradient applied to them was checked finite"]}
    # Negative control: the same reports without the held corruption name two origins on two replicas, no device.
    plain = [RankReport(ranks=ranks(r), findings=(finding(OUTPUT, 40, r),), origin=True,
                        pre_reduction=(finding(OUTPUT, 40, r),)) for r in (1, 2)]
    decision, incident = decide(verdict(), plain, policy(), facts())
    assert decision.signs.held_ranks == () and decision.signs.suspects == ()
    assert incident.record()["cause"]["class"] == "unknown"


def test_the_first_checked_step_and_the_norm_trail_reach_the_signs():
    reports = [RankReport(ranks=ranks(0), findings=(finding(OUTPUT, 40, 0, nan=0),))]
    rising = (1.0, 2.0, 4.0, 8.0, 16.0)
    decision, incident = decide(verdict(total_norm=40.0), reports, policy(), facts(clean_before=5, norm_trail=rising))
    assert not decision.signs.first_checked and decision.signs.growth == (
        "gradient norm rose 16x over the 5 clean checked steps before, to 40 at the fault",)
    assert incident.record()["cause"]["class"] == "numerics"
    assert decision.signs.suspects[0].key() == "host0 cpu:0"  # one replica's finding names the device
    decision, _ = decide(verdict(), reports, policy(), facts(clean_before=0))
    assert decision.signs.first_checked and decision.signs.growth == ()


def _jumped(rank):
    return ParamFinding(name=FC1, layer=1, shape=[4, 4], nan=0, inf=0, overflow=0, norm=None, ranks=ranks(rank),
                        host=f"host{rank}", device=f"cpu:{rank}", order=12, reasons=["local_jump", "pre_reduction"])


def test_a_finite_fault_is_named_on_the_one_replica_whose_own_gradient_jumped():
    """Hole 9 of the campaign: rank 1's own fc1 gradient x1,000 before the reduction; the magnitude check
    sees the reduced gradient on rank 0, the shard holder. Rank 1 alone shows the jump over its running
    mean: it is the origin, and the record names fc1 there. A jump on two replicas at once is the data's
    (a loss spike): nobody is named an origin and the decision is the same single-fault skip."""
    magnitude = ParamFinding(name=FC1, layer=1, shape=[4, 4], nan=0, inf=0, overflow=0, norm=None, ranks=ranks(0),
                             host="host0", device="cpu:0", order=12, reasons=["history"])
    alone = [RankReport(ranks=ranks(0), findings=(magnitude,)), RankReport(ranks=ranks(1), jumped=(_jumped(1),))]
    decision, incident = decide(verdict(total_norm=3.0), alone, policy(), facts())
    assert (decision.action, decision.origins) == ("skip_step", (1,))
    record = incident.record()
    assert record["origin_ranks"] == [1] and record["first"]["ranks"]["global"] == 1 and record["first"]["name"] == FC1
    assert "rank(s) [1] before the data-parallel reduction" in incident.message

    both = [RankReport(ranks=ranks(0), findings=(magnitude,), jumped=(_jumped(0),)),
            RankReport(ranks=ranks(1), jumped=(_jumped(1),))]
    decision, incident = decide(verdict(total_norm=3.0), both, policy(), facts())
    assert (decision.action, decision.origins) == ("skip_step", ())
    assert incident.record()["first"]["ranks"]["global"] == 0


def test_the_held_weights_and_state_are_read_tensor_by_tensor():
    from types import SimpleNamespace

    from megatron_patches.faults import optimizer_states
    from megatron_patches.findings import held_findings
    from megatron_patches.naming import ParamInfo

    weight, clean = torch.ones(4), torch.ones(3)
    leaf = SimpleNamespace(optimizer=torch.optim.Adam([weight, clean], lr=0.1))
    leaf.optimizer.state[weight] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4),
                                    "exp_avg_sq": torch.tensor([1.0, float("inf"), 1.0, 1.0])}
    weight[2] = float("nan")
    clean[0] = 2.0 ** 101  # a top exponent bit flipped: finite, and far beyond any trained weight
    entries = [SimpleNamespace(main=weight, model=weight, info=ParamInfo(FC1, 1, 12, True), shard=True),
               SimpleNamespace(main=clean, model=clean, info=ParamInfo(OUTPUT, None, 40, True), shard=False)]
    found, extreme = held_findings(entries, optimizer_states(SimpleNamespace(chained_optimizers=[leaf])), ranks(1))
    assert (found.name, found.nan, found.inf, found.reasons) == (FC1, 1, 1, ["held:weight", "held:exp_avg_sq"])
    assert (extreme.name, extreme.nan, extreme.inf, extreme.overflow, extreme.reasons) == (OUTPUT, 0, 0, 1, ["held:weight"])


def test_origins_in_one_expert_parallel_group_count_once():
    """EP2 x expert-DP2: ranks 0 and 1 are one EP group; their all-to-all carries one fault to both."""
    layout = {0: (0, 0, 0), 1: (1, 1, 0), 2: (2, 0, 1), 3: (3, 1, 1)}  # rank: (dp, ep, edp)
    reports = [RankReport(ranks=ranks(r, dp=dp, ep=ep, edp=edp), origin=r in (0, 1),
                          findings=(finding(FC1, 12, r, layer=1, dp=dp, ep=ep, edp=edp),) if r in (0, 1) else ())
               for r, (dp, ep, edp) in layout.items()]
    decision, incident = decide(verdict(), reports, policy(), facts())
    assert (decision.severity, decision.origins) == ("warning", (0, 1))
    assert "those ranks are one expert-parallel group" in incident.message
    split = [RankReport(ranks=report.ranks, origin=report.rank in (1, 2)) for report in reports]
    decision, _ = decide(verdict(), split, policy(), facts())
    assert (decision.severity, decision.origins) == ("critical", (1, 2))


def test_ranks_that_did_not_report_are_absent_not_guessed():
    """World of 4, only ranks 1 and 3 reported (the others found nothing and sent nothing)."""
    reports = [RankReport(ranks=ranks(1), findings=(finding(FC1, 12, 1, layer=1),), batch=(7,)),
               RankReport(ranks=ranks(3), injected=({"drill": "nan:step=5", "rank": 3, "param": FC1},), batch=(9,))]
    assert [r.reports() for r in reports] == [True, True] and not RankReport(ranks=ranks(2), batch=(8,)).reports()
    _, incident = decide(verdict(), reports, policy(), facts())
    record = incident.record()
    assert record["ranks_affected"] == [1] and record["batch"]["samples"] == [7, 9]
    assert record["injected"] == [{"drill": "nan:step=5", "rank": 3, "param": FC1}] and record["world"] == WORLD
    assert record["origin_ranks"] == [] and "replicas_reached" not in record


def test_every_gradient_non_finite_says_the_first_named_is_not_the_suspect():
    reports = [RankReport(ranks=ranks(0), findings=(finding(OUTPUT, 40, 0), finding(FC1, 12, 0, layer=1)))]
    _, incident = decide(verdict(), reports, policy(), facts(checked=2))
    assert incident.extra["all_gradients_nonfinite"] is True
    assert incident.message.endswith("so the output layer named first is not the suspect")
    _, incident = decide(verdict(), reports, policy(), facts(checked=3))
    assert "all_gradients_nonfinite" not in incident.extra


def test_grading_follows_the_policy_and_a_direct_clip_is_not_graded():
    reports = [RankReport(ranks=ranks(0), findings=(finding(FC1, 12, 0, layer=1),))]
    p = policy()
    assert decide(verdict(step=1), reports, p, facts())[0].severity == "warning"
    assert decide(verdict(step=2), reports, p, facts(rollbacks=0, can_replay=True))[0].action == "rollback"
    clip = decide(verdict(step=3), reports, policy(), facts(action=Action.ZERO_GRADS))[0]
    assert (clip.severity, clip.action, clip.reason) == ("warning", "zero_grads", "checked in clip_grad_norm")


def test_megatrons_fields_come_from_the_reports_and_join_the_message():
    reports = [RankReport(ranks=ranks(0), findings=(finding(FC1, 12, 0, layer=1),), megatron={"loss_nonfinite": True})]

    def fields(everyone, extra):
        return {"loss_nonfinite": True}, f"; loss on {[r.rank for r in everyone if r.megatron]}"

    _, incident = decide(verdict(), reports, policy(), facts(), fields)
    assert incident.extra["loss_nonfinite"] is True and incident.message.endswith("; loss on [0]")


def test_a_report_survives_the_gather_as_a_value():
    report = RankReport(ranks=ranks(1), findings=(finding(FC1, 12, 1, layer=1),), batch=(3,), moe_routing=None)
    assert pickle.loads(pickle.dumps(report)) == report


def test_a_failure_while_deciding_becomes_a_critical_stop_with_a_record():
    """A report rank 0 cannot read (no data-parallel rank): the guard's own error, in one process."""
    responder = Responder(Config(), [], peers=None, megatron_fields=lambda everyone, extra: ({}, ""),
                          parallel_state=lambda: None)
    broken = RankReport(ranks={"global": 0}, origin=True, findings=(finding(FC1, 12, 0, layer=1),))
    decision, incident = responder.agree(verdict(), broken, action=Action.SKIP_STEP, batch_info={}, rollbacks=0,
                                         can_replay=False)
    assert (decision.severity, decision.action) == ("critical", "stop") and "KeyError" in decision.reason
    assert incident is not None and incident.kind == "guard_error"


def test_own_gradient_norms_are_judged_against_their_running_mean_which_only_clean_steps_move():
    """OriginWatch's ratios (made on the device when read, on the slow path): none on the first step; then each
    norm over its running mean; a flagged step's norms do not join the mean, a clean step's do."""
    from megatron_patches.seams.origin import LOCAL_JUMP, OriginWatch

    watch = OriginWatch(enabled=True)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]

    def ratios(norms):
        return watch._ratios("chunks", torch.tensor(norms)).get().tolist()  # made when read

    assert ratios([1.0, 2.0]) == [0.0, 0.0]
    watch.commit(accepted=True)
    assert ratios([1.0, 2.0 * LOCAL_JUMP]) == [1.0, LOCAL_JUMP]
    watch.commit(accepted=False)  # flagged: the jump stays out of the mean
    assert ratios([1.0, 2.0]) == [1.0, 1.0]
    assert ratios([float("nan"), 4.0])[0] == 0.0  # a non-finite norm is the other check's business


def test_with_the_peak_detector_on_the_pass_before_the_reduction_judges_crest_factors_too():
    """One element x1,000 on one replica lifts its tensor's norm about 8x (under LOCAL_JUMP) but its
    crest factor far more: with ``peak_ratio`` the pass keeps a second series, of crest factors,
    whose jump names the rank (reason ``local_peak``, the peak detector's threshold)."""
    from megatron_patches.seams.origin import LOCAL_JUMP, OriginWatch, _fused_norms

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(128, 128))
    grad = torch.randn(128, 128)
    param.grad = grad.clone()
    held, norms, crests = _fused_norms([param], crests=True)
    assert held == [param] and crests is not None
    assert crests.item() == pytest.approx(float(grad.abs().max() * 128 / grad.norm()), rel=1e-5)
    assert _fused_norms([param])[2] is None  # no second read without the peak detector

    watch = OriginWatch(enabled=True, peak_ratio=8.0)
    first = watch._jumps("chunks", None, held, norms, crests)
    assert [(j[3], j[4]) for j in first] == [("local_jump", LOCAL_JUMP), ("local_peak", 8.0)]
    watch.commit(accepted=True)
    spiked = grad.clone()
    spiked[3, 4] = grad.abs().mean() * 1000
    param.grad = spiked
    _, norms, crests = _fused_norms([param], crests=True)
    norm_jump, crest_jump = (j[2].get().item() for j in watch._jumps("chunks", None, held, norms, crests))
    assert norm_jump < LOCAL_JUMP < crest_jump
    assert len(OriginWatch(enabled=True)._jumps("chunks", None, held, norms, None)) == 1
