"""The optimizer and parallelism variants of issue 24 through Megatron-LM's packaged loop (0.17+), two
CPU ranks: each one guarded, with the promises of the dense data-parallel path.

Per variant: a NaN in the gradient the optimizer applies is named with its ranks, its step leaves
the weights and the optimizer state untouched bit for bit (measured by
:mod:`megatron_patches.testing.step_probe` on every rank) and the steps after it train; a persistent
fault is rolled back to the healthy checkpoint and the job resumes. Guard on versus guard off bit
for bit: tests/trainings/test_served_norm.py.

Stand-ins, named (Transformer Engine needs CUDA and cannot run here): the precision-aware optimizer
needs its ``FusedAdam``, here :class:`megatron_patches.testing.fused_adam.StandInFusedAdam`; context
parallelism needs its attention, here the local attention gathering K and V over the CP group
(:mod:`megatron_patches.testing.context_parallel`, checked against one rank below).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_patches.testing import step_probe
from megatron_lm_loop import (FC1, REPO, TINY, Loop, _packaged_loop_available, guard_env, incidents, iterations,
                             rollback_run)

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not _packaged_loop_available(),
                                 reason="the installed megatron-core ships no megatron/training (0.17+ does)")]

PRECISION_AWARE = ("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer")
BF16_STATES = ("--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
CP2 = ("--context-parallel-size", "2")
OFFLOAD = (*PRECISION_AWARE, "--optimizer-cpu-offload", "--no-pin-cpu-grads", "--no-pin-cpu-params")
VARIANTS = {
    "precision_aware": PRECISION_AWARE,
    "precision_aware_bf16_states": (*PRECISION_AWARE, *BF16_STATES),
    "cp2": CP2,
    "cpu_offload": OFFLOAD,  # --optimizer-offload-fraction 1 (Megatron's default)
    "cpu_offload_half": (*OFFLOAD, "--optimizer-offload-fraction", "0.5"),
    "torch_fsdp2": ("--use-torch-fsdp2", "--untie-embeddings-and-output-weights"),
    "megatron_fsdp": ("--use-megatron-fsdp", "--no-gradient-reduce-div-fusion", "--ckpt-format", "fsdp_dtensor"),
}
SHARDED = {name for name, flags in VARIANTS.items()
           if {"--use-distributed-optimizer", "--use-torch-fsdp2", "--use-megatron-fsdp"} & set(flags)}
DRILL_RANK = {"megatron_fsdp": 1}
"""Where the drill writes: a rank holding part of fc1 (under Megatron-FSDP's uneven shards rank 1 does)."""


def connections(flags) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS as Megatron's argument validation wants it: 1 for tensor and
    context parallelism, more than 1 for FSDP (either)."""
    return "8" if {"--use-torch-fsdp2", "--use-megatron-fsdp"} & set(flags) else "1"
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")


def assert_only_the_skipped_steps_left_everything_untouched(probe_dir, skipped: set[int], last: int) -> None:
    """Every rank's probe: the ``skipped`` iterations changed no bit of the weights or of the
    optimizer state, every other iteration up to ``last`` changed both, all weights stay finite."""
    by_rank = step_probe.read(probe_dir)
    assert len(by_rank) == 2, by_rank
    for rank, lines in by_rank.items():
        assert [line["iteration"] for line in lines] == list(range(1, last + 1)), (rank, lines)
        for line in lines:
            moved = line["iteration"] not in skipped
            assert (line["weights_changed"], line["state_changed"], line["finite"]) == (moved, moved, True), (rank, line)


# CI keeps one of each pair (bf16 states, offload fraction 1); make test-all runs every variant.
SLOW_IN_CI = {"precision_aware", "cpu_offload_half"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_IN_CI else n
                                  for n in sorted(VARIANTS)])
def test_a_nan_the_optimizer_would_apply_is_named_and_its_step_leaves_weights_and_state_untouched(tmp_path, name):
    """The drill writes the NaN into the gradient the optimizer applies on rank 0: under the
    precision-aware optimizer the shards' ``decoupled_grad`` (the fp32 or bf16 main gradient beside
    a bf16 parameter shard, ``.grad`` None), rank 0's shard of fc1; with CPU offload the same, before
    ``HybridDeviceOptimizer.step`` copies it to the host copies it steps; under FSDP2 and
    Megatron-FSDP the rank's shard of the DTensor gradient, after the reduce-scatter."""
    rank = DRILL_RANK.get(name, 0)
    env = {**guard_env(tmp_path, inject=[f"nan:step=3,rank={rank},phase=grad,param={FC1}"]),
           step_probe.ENV: str(tmp_path / "probe"), "CUDA_DEVICE_MAX_CONNECTIONS": connections(VARIANTS[name])}
    proc = Loop(None).run(env, *VARIANTS[name])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["kind"]) == (3, "skip_step", "nan"), incident
    first = incident["first"]
    assert (first["name"], first["layer"], first["shard"], first["nan"]) == (FC1, 1, name in SHARDED, 1), first
    assert first["ranks"]["global"] == rank and first["ranks"]["dp"] == rank
    assert first["shape"] == [256, 64]  # the parameter's, not its shard's
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and "number of skipped iterations:   1" in logged[3]
    assert_only_the_skipped_steps_left_everything_untouched(tmp_path / "probe", skipped={3}, last=6)


# The variants' restart rollbacks run in make test-all: CI keeps their in-process rollback, which
# restores the same state exactly (tests/trainings/test_rollback_in_process.py), within its time budget.
@pytest.mark.parametrize("name", [pytest.param("precision_aware_bf16_states", marks=pytest.mark.slow),
                                  pytest.param("cpu_offload_half", marks=pytest.mark.slow),
                                  pytest.param("torch_fsdp2", marks=pytest.mark.slow),
                                  pytest.param("megatron_fsdp", marks=pytest.mark.slow)])
def test_optimizer_variant_persistent_nan_is_rolled_back_to_its_checkpoint_and_resumed(tmp_path, monkeypatch, name):
    """Precision-aware with bf16 moments and main gradients: Megatron saves them through the
    optimizer's ``get_unscaled_state`` and loads them with ``set_scaled_state``; CPU offload: through
    ``HybridDeviceOptimizer``'s state (torch_dist format, both); FSDP2: DTensor shards in torch_dist;
    Megatron-FSDP: its fsdp_dtensor format. Under FSDP the drill lands in the gradient after the
    reduce-scatter (there is no view of a rank's own gradient before it): phase grad."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections(VARIANTS[name]))
    phase = "grad" if name.endswith("fsdp2") or name.endswith("fsdp") else "local"
    first, second = rollback_run(Loop(None), tmp_path, f"nan:step=4,count=2,rank=1,phase={phase},param={FC1}",
                                 *VARIANTS[name])
    found = incidents(tmp_path)
    assert [(i["step"], i["severity"], i["action"]) for i in found] == [(4, "warning", "skip_step"),
                                                                        (5, "error", "rollback")], found
    assert all(i["first"]["name"] == FC1 and i["first"]["ranks"]["global"] == 1 for i in found)
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]


def _cp_run(tmp_path, drill: str, *extra: str) -> tuple[dict, str]:
    env = {**guard_env(tmp_path, inject=[drill]), step_probe.ENV: str(tmp_path / "probe"),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = Loop(None).run(env, *CP2, *extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"]) == (3, "skip_step"), incident
    assert_only_the_skipped_steps_left_everything_untouched(tmp_path / "probe", skipped={3}, last=6)
    return incident, output


def test_context_parallel_names_the_cp_rank_whose_own_gradient_broke(tmp_path):
    """CP2 on two ranks (data-parallel size 1): rank 1 holds the second and third quarter of each
    sequence; its own fc1 gradient goes NaN before the reduction over the data- and
    context-parallel group, which spreads it to rank 0."""
    incident, _ = _cp_run(tmp_path, f"nan:step=3,rank=1,phase=local,param={FC1}", "--no-check-for-nan-in-loss-and-grad")
    assert incident["origin_ranks"] == [1] and incident["first"]["name"] == FC1
    ranks = incident["first"]["ranks"]
    assert (ranks["global"], ranks["cp"], ranks["dp"]) == (1, 1, 0), ranks


def test_context_parallel_attention_nan_is_born_on_one_rank_and_shows_on_both(tmp_path):
    """A NaN out of layer 0's attention on CP rank 1 reaches rank 0 through layer 1's K/V exchange:
    both ranks' losses go NaN (Megatron's check sees it on both), every gradient is NaN; the
    guard's forward trace names layer 0's attention on rank 1."""
    incident, _ = _cp_run(tmp_path, "nan:step=3,rank=1,phase=forward,module=decoder.layers.0.self_attention")
    assert incident["loss_nonfinite"] is True and sorted(incident["origin_ranks"]) == [0, 1], incident
    assert incident["forward_origin"] == {"module": "decoder.layers.0.self_attention", "layer": 0, "ranks": [1]}


def test_context_parallel_persistent_nan_is_rolled_back_to_its_checkpoint_and_resumed(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    first, second = rollback_run(Loop(None), tmp_path, f"nan:step=4,count=2,rank=1,phase=local,param={FC1}", *CP2)
    found = incidents(tmp_path)
    assert [(i["step"], i["severity"], i["action"]) for i in found] == [(4, "warning", "skip_step"),
                                                                        (5, "error", "rollback")], found
    assert all(i["origin_ranks"] == [1] and i["first"]["ranks"]["cp"] == 1 for i in found)
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]


def test_the_stand_in_context_parallel_attention_trains_as_one_rank_does(tmp_path):
    """CP2 over two ranks and the same job on one rank (no dropout, the same global batch): the
    losses and grad norms Megatron logs agree to 1e-6 relative (summation order differs)."""
    logged = {}
    for nproc, extra in ((2, CP2), (1, ())):
        env = {**guard_env(tmp_path), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        proc = replace(Loop(None), nproc=nproc).run(env, *NO_DROPOUT, *extra, "--no-guard")
        assert proc.returncode == 0, proc.stdout[-4000:]
        logged[nproc] = [tuple(float(v) for v in re.search(r"lm loss: (\S+) .*grad norm: (\S+) ", line).groups())
                         for _, line in sorted(iterations(proc.stdout).items())]
    assert len(logged[1]) == 6 and len(logged[2]) == 6
    for cp, one in zip(logged[2], logged[1]):
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(cp, one)), logged


SERVES_THE_NORM = {"precision_aware": True, "precision_aware_bf16_states": False, "cp2": True, "cpu_offload_half": True,
                   "torch_fsdp2": True, "megatron_fsdp": False}
"""Whether ``serve_norm: true`` hands Megatron the guard's norm under the variant. Not with bf16 main
gradients (Megatron's own kernel sums those; megatron_patches.seams.served_norm) nor under
Megatron-FSDP, whose optimizer computes the norm and clips in one call (``clip_grad_norm``)."""


@pytest.mark.parametrize("name", [n if n == "precision_aware_bf16_states" else
                                  pytest.param(n, marks=pytest.mark.slow) for n in sorted(SERVES_THE_NORM)])
def test_serve_norm_under_a_variant_serves_megatrons_own_norm_or_leaves_it_to_megatron(tmp_path, name):
    """``serve_norm: true``, 6 iterations, Megatron's norm computation watched (tests/norm_audit.py):
    where the guard serves, every step's norm equals what Megatron's own code gives for the same
    gradients to float32 rounding; elsewhere Megatron computes every norm itself."""
    audit = tmp_path / "audit"
    env = {**guard_env(tmp_path, serve_norm=True), "CUDA_DEVICE_MAX_CONNECTIONS": connections(VARIANTS[name])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "tests" / "norm_audit.py"), "--run-module", "megatron_patches.testing.pretrain_cpu",
               *TINY, *VARIANTS[name], "--out", str(audit)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert incidents(tmp_path) == [] and sorted(iterations(proc.stdout)) == list(range(1, 7))
    for rank in (0, 1):
        audited = json.loads((audit / f"norm_audit.rank{rank}.json").read_text())
        served = audited["served"]
        if SERVES_THE_NORM[name]:
            assert audited["stock_calls"] == [] and [step for step, _, _ in served] == list(range(1, 7)), audited
            assert all(abs(mine - stock) <= 1e-6 * stock for _, mine, stock in served), served
        else:
            assert served == [] and audited["stock_calls"] == list(range(1, 7)), audited
