"""Mixture-of-experts with expert parallelism (issue 23): guarded through Megatron-LM's packaged
loop (megatron-core 0.17+) on CPU ranks, each fault named with its expert and the rank where it
was born; and the pieces that decide it, in-process.

The end-to-end runs train megatron-core's MoE layers (router, token dispatcher, sequential
experts) built by megatron-core's own block spec from Megatron's arguments: 4 experts, top-2,
EP2 on 2 ranks (each rank holds 2 experts: EP rank e holds experts 2e, 2e+1) and EP2 x
expert-DP2 on 4 ranks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from megatron_patches import decide, findings, forward_origin, naming, moe_routing
from megatron_patches.incident_text import diagnosis, expert_text
from megatron_patches.incidents import ParamFinding

from megatron_patches.ledger import Ledger
from conftest import run_packaged_loop
from megatron_lm_loop import (REPO, TINY, Loop, _packaged_loop_available, guard_env, incidents, iterations,
                              report_text, rollback_run)

MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2", "--disable-bias-linear"]
EXPERT_FC1 = "decoder.layers.1.mlp.experts.local_experts.{k}.linear_fc1.weight"
EXPERT_MODULE = "decoder.layers.1.mlp.experts.local_experts.1"


# --- in-process: naming, ordering, counting ------------------------------------------------------


@pytest.mark.parametrize("name, ep_rank, per_rank, expected", [
    (EXPERT_FC1.format(k=1), 1, 2, (3, 1)),                      # sequential experts' parameter
    (EXPERT_MODULE, 1, 2, (3, 1)),                               # ... and module
    (EXPERT_MODULE + ".linear_fc2", 0, 2, (1, 1)),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight3", 1, 4, (7, 3)),  # Transformer Engine's grouped experts
    ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", 1, 2, None),
    ("decoder.layers.0.mlp.router.weight", 1, 2, None),
    ("decoder.layers.0.mlp.linear_fc1.weight", 0, 2, None),
])
def test_expert_of_gives_the_global_and_local_expert_index(name, ep_rank, per_rank, expected):
    assert naming.expert_of(name, ep_rank, per_rank) == expected


@pytest.mark.parametrize("attrs, tp_rank, etp_rank, counts", [
    ({"tensor_model_parallel": True, "allreduce": False}, 1, 1, True),  # an expert weight's ETP slice
    ({"allreduce": False}, 1, 0, True),   # an expert weight replicated over TP, ETP 1: expert-TP rank 0 counts it
    ({"allreduce": False}, 0, 1, False),  # ... replicated over the expert-TP group: only its rank 0 counts it
    ({}, 1, 0, False),                    # a dense replicated weight: tensor-parallel rank 0 counts it
    ({"tensor_model_parallel": True, "shared": True}, 0, 0, False),  # a tied copy never
])
def test_an_expert_weights_copies_count_in_the_norm_once_per_expert_tensor_parallel_group(attrs, tp_rank, etp_rank,
                                                                                            counts):
    """Megatron's grad norm skips a replicated parameter's copies on all but rank 0 of its group:
    the expert-TP group for the routed experts' parameters (reduced over expert-DP, ``allreduce``
    False), the TP group for the rest."""
    param = torch.nn.Parameter(torch.zeros(2))
    for key, value in attrs.items():
        setattr(param, key, value)
    assert naming.counts_in_norm(param, tp_rank, etp_rank) is counts


def _first(module: str, call: int, stage: int = 0, expert: dict | None = None) -> dict:
    return {"module": module, "stage": stage, "call": call, **({"expert": expert} if expert else {})}


def test_the_earliest_call_wins_across_expert_parallel_ranks_not_the_lowest_rank():
    """Rank 0's first non-finite output is the MoE layer's (the combine all-to-all brought the
    NaN), a later call than rank 1's expert, where it was born."""
    expert = {"global": 3, "local": 1, "ep": 1}
    everyone = [{"rank": 0, "first": _first("decoder.layers.1.mlp", 41)},
                {"rank": 1, "first": _first(EXPERT_MODULE, 37, expert=expert)}]
    assert forward_origin.earliest(everyone) == {"module": EXPERT_MODULE, "layer": 1, "ranks": [1], "expert": expert}


def test_backward_origin_is_given_only_when_the_forward_pass_stayed_finite():
    """Backward runs the pipeline from the last stage: there the latest stage comes first."""
    parts = [{"rank": 0, "forward": None, "backward": _first("decoder.layers.0.mlp", 3, stage=0)},
             {"rank": 1, "forward": None, "backward": _first("decoder.layers.3.mlp", 5, stage=1)}]
    forward, backward = forward_origin.origins_from(parts)
    assert forward is None and backward == {"module": "decoder.layers.3.mlp", "layer": 3, "ranks": [1]}
    parts[0]["forward"] = _first("decoder.layers.0.self_attention", 9)
    forward, backward = forward_origin.origins_from(parts)
    assert forward["ranks"] == [0] and backward is None


def _part(rank: int, dp: int, ep: int, edp: int, origin: bool) -> findings.RankReport:
    return findings.RankReport(ranks={"global": rank, "tp": 0, "pp": 0, "dp": dp, "cp": 0, "ep": ep, "edp": edp,
                                      "vpp": 0}, origin=origin)


def test_ranks_of_one_expert_parallel_group_count_as_one_origin():
    """EP2 x expert-DP2 on 4 ranks: ranks {0, 1} and {2, 3} are the EP groups. Both members of
    one group flagged is one fault carried by the all-to-all; one member of each is two."""
    layout = [(0, 0, 0, 0), (1, 1, 1, 0), (2, 2, 0, 1), (3, 3, 1, 1)]
    one_group = [_part(r, dp, ep, edp, origin=r in (0, 1)) for r, dp, ep, edp in layout]
    assert decide.origins_of(one_group) == ([0, 1], 1)
    two_groups = [_part(r, dp, ep, edp, origin=r in (1, 2)) for r, dp, ep, edp in layout]
    assert decide.origins_of(two_groups) == ([1, 2], 2)
    dense = [_part(r, r, 0, r, origin=r in (1, 2)) for r in range(4)]  # no expert parallelism
    assert decide.origins_of(dense) == ([1, 2], 2)


def test_a_finding_on_an_expert_carries_it_in_the_record_and_the_text():
    info = naming.ParamInfo(name=EXPERT_FC1.format(k=1), layer=1, order=20, counts_in_norm=True, expert=(3, 1))
    ranks = {"global": 1, "tp": 0, "pp": 0, "dp": 1, "cp": 0, "ep": 1, "edp": 0, "vpp": 0}
    finding = ParamFinding.located(info, ranks, shape=[256, 64], nan=1, inf=0, overflow=0, norm=None,
                                   host="h", device="cpu")
    record = finding.as_record()
    assert record["expert"] == {"global": 3, "local": 1} and record["ranks"]["ep"] == 1
    assert expert_text(record["expert"], record["ranks"]) == "expert 3 (EP rank 1, expert-DP rank 0)"
    dense = ParamFinding.located(None, ranks, shape=[4], nan=1, inf=0, overflow=0, norm=None, host="h", device="cpu")
    assert "expert" not in dense.as_record() and dense.name == "<unnamed (4,)>"


class _Router(torch.nn.Module):
    """Stands in for megatron-core's TopKRouter: its output is (probs, routing_map)."""

    def forward(self, probs, routing_map):
        return probs, routing_map


def _model_with_a_router() -> torch.nn.Module:
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].mlp = torch.nn.Module()
    model.decoder.layers[0].mlp.router = _Router()
    return model


def test_the_routing_watch_keeps_one_passs_tokens_per_expert_and_router_finiteness():
    model, step = _model_with_a_router(), [3]
    watch = moe_routing.RoutingWatch(lambda: step[0], lambda s: s != 5)  # step 5 is not checked
    assert watch.attach([model], None) == 1 and watch.attach([model], None) == 0  # hooked once
    router = model.decoder.layers[0].mlp.router
    to_expert = lambda *experts: torch.nn.functional.one_hot(torch.tensor(experts), 4).bool()  # noqa: E731
    router(torch.rand(3, 4), to_expert(0, 0, 2))  # two micro-batches of step 3
    router(torch.rand(2, 4), to_expert(2, 3))
    assert watch.share(3) == {"decoder.layers.0.mlp": {"tokens_per_expert": [2, 0, 2, 1], "router_finite": True}}
    watch.restart()  # Megatron reruns the step in place: the rerun's pass alone
    router(torch.tensor([[float("nan"), 0, 0, 0]]), to_expert(1))
    assert watch.share(3) == {"decoder.layers.0.mlp": {"tokens_per_expert": [0, 1, 0, 0], "router_finite": False}}
    assert watch.share(4) is None
    step[0] = 5
    router(torch.rand(1, 4), to_expert(1))
    assert watch.share(5) is None


def test_the_routing_record_sums_ranks_and_names_experts_without_tokens_and_broken_routers():
    shares = [(0, {"l0": {"tokens_per_expert": [3, 0, 1, 0], "router_finite": True}}),
              (1, {"l0": {"tokens_per_expert": [1, 0, 2, 2], "router_finite": False}})]
    assert decide.routing_field(shares) == {"layers": {"l0": {
        "tokens_per_expert": [4, 0, 3, 2], "router_nonfinite_ranks": [1], "zero_token_experts": [1]}}}
    assert decide.routing_field([]) is None
    text = diagnosis({"moe_routing": decide.routing_field(shares), "step": 3})
    assert "  routing: l0: router probabilities non-finite on rank(s) [1]; l0: no tokens for expert(s) [1]" in text


# --- Megatron-LM's packaged loop, EP2 on CPU ranks ------------------------------------------------

needs_packaged_loop = pytest.mark.skipif(not _packaged_loop_available(),
                                         reason="megatron-core ships megatron/training from 0.17 on")


def moe_run(tmp_path: Path, *extra: str, drill: str | None = None, nproc: int = 2,
            prefix: tuple = (), tensor_parallel: bool = False, **config) -> subprocess.CompletedProcess:
    """Megatron-LM's packaged loop with the MoE flags and ``extra``; ``config``: guard config keys;
    ``tensor_parallel``: sets CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron's validation asks for."""
    env = guard_env(tmp_path, **({"inject": [drill]} if drill else {}), **config)
    if tensor_parallel:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if not prefix:  # the ranks forked from this process, output all in stdout
        code, output = run_packaged_loop(env, [*TINY, *MOE, *extra], nproc=nproc)
        assert code == 0, output[-6000:]
        return subprocess.CompletedProcess(["pretrain_cpu", *extra], code, output, "")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *prefix, *TINY, *MOE, *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


def assert_guard_norm_is_megatrons(tmp_path: Path, output: str, steps: list[int]) -> None:
    """Megatron printed a grad norm on exactly ``steps`` (the others were skipped), and on each the
    guard's own total norm (grad_history.jsonl) is that norm to the digits Megatron prints."""
    history = [json.loads(line) for line in (tmp_path / "reports" / "grad_history.jsonl").read_text().splitlines()]
    printed = {step: float(line.split("grad norm: ")[1].split()[0])
               for step, line in iterations(output).items() if "grad norm: " in line}
    assert sorted(printed) == steps and {h["step"] for h in history} >= set(steps)
    for h in history:
        if h["step"] in printed:
            assert round(h["total_norm"], 3) == printed[h["step"]], (h, printed)


@needs_packaged_loop
@pytest.mark.multiproc
@pytest.mark.parametrize("layout, nproc", [
    ((), 2),
    # TP2 x EP2 with expert tensor parallel 2 (Megatron's default under TP), 4 ranks; 28 s here.
    pytest.param(("--tensor-model-parallel-size", "2", "--sequence-parallel"), 4, marks=pytest.mark.slow),
], ids=["ep2", "tp2-ep2-etp2"])
def test_a_clean_expert_parallel_job_trains_guarded_and_gets_megatrons_own_norm(tmp_path, layout, nproc):
    """EP2, bf16, distributed optimizer, alltoall dispatcher, 8 iterations, ``serve_norm: true``: no
    incident, and on every step the norm the guard served equals what Megatron's own get_grad_norm
    gives for the same dense and expert gradients (to float32 rounding; by default Megatron computes
    its own, tests/trainings/test_served_norm.py)."""
    audit = tmp_path / "audit"
    proc = moe_run(tmp_path, "--train-iters", "8", "--bf16", "--use-distributed-optimizer", *layout,
                   "--moe-token-dispatcher-type", "alltoall", "--out", str(audit), serve_norm=True, nproc=nproc,
                   tensor_parallel=bool(layout),
                   prefix=(str(REPO / "tests" / "norm_audit.py"), "--run-module", "megatron_patches.testing.pretrain_cpu"))
    assert incidents(tmp_path) == []
    assert sorted(iterations(proc.stdout)) == list(range(1, 9))
    for rank in range(nproc):
        audit_of_rank = json.loads((audit / f"norm_audit.rank{rank}.json").read_text())
        assert audit_of_rank["stock_calls"] == []  # every norm of the run was the guard's
        served = audit_of_rank["served"]
        assert [step for step, _, _ in served] == list(range(1, 9))
        assert all(abs(mine - stock) <= 1e-6 * stock for _, mine, stock in served), served


@needs_packaged_loop
@pytest.mark.multiproc
@pytest.mark.parametrize("flags", [
    (),  # stock: Megatron's bucket check and rerun machine act first
    ("--no-check-for-nan-in-loss-and-grad", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
     "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"),  # the guard owns the step
], ids=["stock", "guard-owns-bf16-distopt-overlap-auxloss"])
def test_a_nan_in_one_experts_weight_gradient_is_named_with_its_expert_and_ep_rank(tmp_path, flags):
    """Rank 1 holds experts 2 and 3; its local expert 1 is global expert 3."""
    moe_run(tmp_path, "--train-iters", "5", "--moe-token-dispatcher-type", "alltoall", *flags,
            drill=f"nan:step=3,rank=1,phase=local,param={EXPERT_FC1.format(k=1)}")
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["severity"], incident["origin_ranks"]) == (3, "warning", [1])
    first = incident["first"]
    assert first["name"] == EXPERT_FC1.format(k=1) and first["expert"] == {"global": 3, "local": 1}
    assert (first["ranks"]["ep"], first["ranks"]["edp"]) == (1, 0)
    assert "expert 3 (EP rank 1)" in incident["message"]
    assert "expert 3 (EP rank 1, expert-DP rank 0)" in report_text(tmp_path)


@needs_packaged_loop
@pytest.mark.multiproc
def test_a_forward_nan_in_one_ranks_expert_is_named_there_not_where_the_loss_broke(tmp_path):
    """allgather dispatcher, Megatron's own checks on (stock flags). The NaN in rank 1's expert 3
    output comes back to rank 0 through the token exchange: rank 0's loss is NaN and both ranks'
    gradients are non-finite. Megatron's rerun in place is traced on both ranks: the earliest
    non-finite call is rank 1's expert. The two ranks are one EP group: one origin, a warning."""
    moe_run(tmp_path, "--train-iters", "5", "--moe-token-dispatcher-type", "allgather",
            drill=f"nan:step=3,rank=1,phase=forward,module={EXPERT_MODULE}")
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["severity"], incident["action"]) == (3, "warning", "skip_step")
    assert incident["loss_nonfinite"] is True and incident["origin_ranks"] == [0, 1]
    assert incident["forward_origin"] == {"module": EXPERT_MODULE, "layer": 1, "ranks": [1],
                                          "expert": {"global": 3, "local": 1, "ep": 1}}
    assert "counted as one origin" in incident["message"]
    # The routing of the step as Megatron's rerun routed it (one pass: 4 samples x 32 tokens x top-2).
    routing = incident["moe_routing"]["layers"]
    assert sorted(routing) == ["decoder.layers.0.mlp", "decoder.layers.1.mlp"]
    assert all(sum(layer["tokens_per_expert"]) == 256 and layer["router_nonfinite_ranks"] == []
               for layer in routing.values()), routing
    assert any("output of " + EXPERT_MODULE + " (layer 1), expert 3 (EP rank 1) on rank(s) [1]" in line
               for line in diagnosis(incident)), diagnosis(incident)


@needs_packaged_loop
@pytest.mark.multiproc
def test_a_nan_born_in_backward_in_one_ranks_expert_is_named_by_the_backward_origin(tmp_path):
    """``phase=backward``: a NaN in the gradient flowing into rank 1's expert 3; rank 0 gets it
    back through the dispatch's backward exchange. The forward pass stays finite, so the rerun's
    trace of the gradients at module outputs names the birthplace."""
    moe_run(tmp_path, "--train-iters", "5", "--moe-token-dispatcher-type", "alltoall",
            drill=f"nan:step=3,rank=1,phase=backward,module={EXPERT_MODULE}")
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["severity"]) == (3, "warning")
    assert "forward_origin" not in incident
    assert incident["backward_origin"] == {"module": EXPERT_MODULE, "layer": 1, "ranks": [1],
                                           "expert": {"global": 3, "local": 1, "ep": 1}}
    assert any("the backward pass, the gradient into " + EXPERT_MODULE in line for line in diagnosis(incident))


@needs_packaged_loop
@pytest.mark.multiproc
def test_expert_data_parallel_replicas_name_the_rank_whose_expert_gradient_broke(tmp_path):
    """4 ranks, EP2 x expert-DP2: rank 3 is EP rank 1, expert-DP rank 1; its local expert 0 is
    global expert 2. The expert gradient is reduced with rank 1's before the check: the origin
    is taken before that reduction."""
    moe_run(tmp_path, "--train-iters", "4", "--global-batch-size", "8", "--moe-token-dispatcher-type", "alltoall",
            drill=f"nan:step=3,rank=3,phase=local,param={EXPERT_FC1.format(k=0)}", nproc=4)
    [incident] = incidents(tmp_path)
    assert (incident["severity"], incident["origin_ranks"]) == ("warning", [3])
    first = incident["first"]
    assert first["expert"] == {"global": 2, "local": 0} and (first["ranks"]["ep"], first["ranks"]["edp"]) == (1, 1)


# In make test-all: CI keeps the EP2 MoE rollback in process (test_rollback_in_process.py[ep2_moe]),
# which restores the same state exactly; this is the restart path of the same layout (~22 s quiet).
@pytest.mark.slow
@needs_packaged_loop
@pytest.mark.multiproc
def test_a_persistent_expert_fault_rolls_back_and_the_moe_job_resumes_from_the_healthy_checkpoint(tmp_path):
    """The rollback path on a MoE model: exit 84 at iteration 5, the project's launcher restarts,
    megatron-core's torch_dist checkpoint of iteration 2 (expert shards on their EP ranks; certified
    by the clean check of 3) is loaded, 3 trains again, 4 and 5 are skipped, 6 trains, at half the
    learning rate."""
    first, second = rollback_run(Loop(None), tmp_path, f"nan:step=4,count=2,rank=1,phase=local,param={EXPERT_FC1.format(k=1)}",
                                 *MOE, "--moe-token-dispatcher-type", "alltoall")
    assert [(i["step"], i["severity"]) for i in incidents(tmp_path)] == [(4, "warning"), (5, "error")]
    assert all(i["first"]["expert"] == {"global": 3, "local": 1} for i in incidents(tmp_path))
    assert "ledger: rollback 1 requested at iteration 5" in first
    resumed = iterations(second)
    assert sorted(resumed) == [3, 6]
    assert all("learning rate: 5.000000E-04" in line for line in resumed.values())
    ledger = Ledger.load(str(tmp_path / "ckpt"))
    assert ledger.events[0]["skip_iterations"] == [4, 5] and ledger.events[1]["resumed_from"] == 2


@needs_packaged_loop
@pytest.mark.multiproc
def test_experts_beside_tensor_parallel_are_named_and_the_guards_norm_is_megatrons(tmp_path):
    """4 ranks, TP2 x DP2 with sequence parallel (MoE with TP needs it; the CPU runtime's stand-in
    norm), EP2 with expert tensor parallel 1. A NaN in rank 3's local expert 0: global expert 2,
    named with its tp, dp, ep and expert-DP ranks. On the other steps the total norm the guard
    computed (grad_history.jsonl) is the grad norm Megatron printed."""
    flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                 "--moe-token-dispatcher-type", "alltoall", "--train-iters", "4", "--global-batch-size", "8")
    proc = moe_run(tmp_path, *flags, tensor_parallel=True, drill=f"nan:step=3,rank=3,phase=local,param={EXPERT_FC1.format(k=0)}",
                   nproc=4)
    [incident] = incidents(tmp_path)
    assert (incident["severity"], incident["origin_ranks"]) == ("warning", [3])
    first = incident["first"]
    assert first["expert"] == {"global": 2, "local": 0}
    assert {k: first["ranks"][k] for k in ("tp", "dp", "ep", "edp")} == {"tp": 1, "dp": 1, "ep": 1, "edp": 1}
    assert_guard_norm_is_megatrons(tmp_path, proc.stdout, steps=[1, 2, 4])


# --- experts split over expert-tensor-parallel ranks (issue 39) ----------------------------------

ETP = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall")
"""TP2 x DP2 on 4 ranks, EP2, no ``--expert-tensor-parallel-size``: Megatron's default for MoE, the
tensor-parallel size (ETP 2, expert-DP 1). Expert-TP rank is fastest, then EP: rank 3 is etp 1,
ep 1, edp 0 and holds the second half of experts 2 and 3 (its local experts 0 and 1)."""
ETP_SHARD = f"nan:step=3,rank=3,phase=local,param={EXPERT_FC1.format(k=0)}"


@needs_packaged_loop
@pytest.mark.multiproc
@pytest.mark.parametrize("ep, expected", [
    ("2", {"expert": {"global": 2, "local": 0}, "ranks": {"ep": 1, "edp": 0, "etp": 1}}),
    # EP1: expert-DP 2, rank 3's expert gradient is reduced with rank 1's (etp 1, edp 0) before the check.
    pytest.param("1", {"expert": {"global": 0, "local": 0}, "ranks": {"ep": 0, "edp": 1, "etp": 1}},
                 marks=pytest.mark.slow),
], ids=["ep2-edp1", "ep1-edp2"])
def test_an_expert_tensor_parallel_shard_is_named_with_its_expert_and_ranks_and_the_norm_is_megatrons(
        tmp_path, ep, expected):
    """A NaN in rank 3's slice of its local expert 0: named with the global and local expert, its
    ep, edp and etp, and the slice's shape; the origin taken before the expert-DP reduction (rank 3
    alone). On the other steps the guard's own total norm is the grad norm Megatron printed. The
    alltoall dispatcher gathers pieces of different lengths over the expert-TP group (the CPU
    runtime pads them for gloo)."""
    proc = moe_run(tmp_path, *ETP, "--expert-model-parallel-size", ep, "--train-iters", "4", tensor_parallel=True,
                   drill=ETP_SHARD, nproc=4)
    assert re.search(r"expert_tensor_parallel_size \.+ 2\b", proc.stdout)  # Megatron's default: ETP = TP
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["severity"], incident["origin_ranks"]) == (3, "warning", [3])
    first = incident["first"]
    assert first["name"] == EXPERT_FC1.format(k=0) and first["expert"] == expected["expert"]
    assert {k: first["ranks"][k] for k in ("global", "tp", "ep", "edp", "etp")} == \
        {"global": 3, "tp": 1, **expected["ranks"]}
    assert first["shape"] == [128, 64] and first["full_shape"] == [256, 64]  # rank 3's half of the weight
    text = report_text(tmp_path)
    assert (f"expert {expected['expert']['global']} (EP rank {expected['ranks']['ep']}, expert-DP rank "
            f"{expected['ranks']['edp']}, expert-TP rank 1)") in text and "slice [128, 64] of [256, 64]" in text, text
    assert [p["ranks"]["global"] for p in incident["pre_reduction"]] == [3]
    assert_guard_norm_is_megatrons(tmp_path, proc.stdout, steps=[1, 2, 4])


@needs_packaged_loop
@pytest.mark.multiproc
@pytest.mark.slow
def test_a_guarded_expert_tensor_parallel_run_equals_an_unguarded_one_bit_for_bit(tmp_path):
    """TP2 x EP2 with ETP 2 on 4 ranks, 20 iterations: every loss and grad norm Megatron prints and
    every bit of every rank's weights and optimizer state after every iteration are the same with
    the guard and without it (tests/trainings/test_served_norm.py)."""
    from test_served_norm import _guarded_equals_unguarded

    _guarded_equals_unguarded(tmp_path, (*MOE, *ETP), nproc=4)


@needs_packaged_loop
@pytest.mark.multiproc
@pytest.mark.slow
def test_a_persistent_fault_in_an_expert_tensor_parallel_shard_rolls_back_and_the_job_completes(tmp_path,
                                                                                              monkeypatch):
    """The ETP 2 layout above, rank 3's expert shard NaN at iterations 4 and 5, recovery by a
    restart: exit 84 at 5, iteration 2's torch_dist checkpoint (each expert's slices on their
    expert-TP ranks; certified by the clean check of 3) loaded, 3 trained, 4 and 5 skipped through
    Megatron's dummy_train_step, 6 trained."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # guard_env copies the environment
    drill = ETP_SHARD.replace("step=3,", "step=4,count=2,")
    first, second = rollback_run(Loop(None, nproc=4), tmp_path, drill, *MOE, *ETP,
                                 config={"recovery": {"mode": "restart"}})
    found = incidents(tmp_path)
    assert [(i["step"], i["severity"], i["action"]) for i in found] == [(4, "warning", "skip_step"),
                                                                        (5, "error", "rollback")]
    assert all(i["first"]["expert"] == {"global": 2, "local": 0} and i["first"]["ranks"]["etp"] == 1 for i in found)
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]
