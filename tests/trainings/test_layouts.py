"""Megatron-LM's own loop on the layouts users run (issue 28): each layout with Megatron's check on
(stock flags) and off (the guard owns the step), a NaN in one rank's own gradient and a NaN in
one module's forward output on one rank. In CI each layout runs its forward NaN with Megatron's
check off (the case only the guard's replay names); the rest is the full matrix behind the
``layout_matrix`` marker (``make layout-matrix``; its last result is in docs/megatron_lm.md).

The ranks: Megatron orders them tensor-parallel fastest, pipeline slowest, so rank 1 is tp 1
(pp 0, dp 0) wherever TP is 2, and pp 1 in PP2 alone. With one layer per virtual stage over four
layers, pipeline rank 0 holds layers 0 and 2, pipeline rank 1 layers 1 and 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest

from conftest import run_packaged_loop
from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    ITERATION_LINE, REDONE, TINY, _packaged_loop_available, guard_env, incidents, iterations, loop_kind, make_loop,
    megatron_lm_checkout, rollback_run)

pytestmark = pytest.mark.multiproc

TP2 = ("--tensor-model-parallel-size", "2")
VIRTUAL = ("--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8")


@dataclass(frozen=True)
class Layout:
    flags: tuple
    ranks: int = 2
    layer: int = 1
    """A layer rank 1 holds (the drills act there)."""
    expected_ranks: tuple = ()
    """(key, value) pairs of rank 1's ranks the record must name."""


LAYOUTS = {
    "tp2": Layout(TP2, expected_ranks=(("tp", 1), ("pp", 0), ("dp", 0))),
    "tp2_sp": Layout((*TP2, "--sequence-parallel"), expected_ranks=(("tp", 1), ("dp", 0))),
    "tp2_bf16_distopt_overlap": Layout((*TP2, "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"),
                                       expected_ranks=(("tp", 1), ("dp", 0))),
    "pp2_vpp": Layout(("--pipeline-model-parallel-size", "2", *VIRTUAL), expected_ranks=(("pp", 1), ("vpp", 0))),
    "tp2_pp2": Layout((*TP2, "--pipeline-model-parallel-size", "2", *VIRTUAL), ranks=4, layer=2,
                      expected_ranks=(("tp", 1), ("pp", 0), ("vpp", 1))),
    "tp2_dp2": Layout(TP2, ranks=4, expected_ranks=(("tp", 1), ("dp", 0))),
}
CHECKS = {"stock": (), "guard_owns": ("--no-check-for-nan-in-loss-and-grad",)}


def _loop(loop_kind, request, tmp_path, layout: Layout):
    if loop_kind == "checkout" and layout.ranks == 4 and "--pipeline-model-parallel-size" in layout.flags:
        pytest.skip("core_v0.16.1 on CPU: TP2 with an interleaved schedule trains non-deterministically "
                    "(docs/megatron_lm.md, known issues)")
    return replace(make_loop(loop_kind, request, tmp_path, only="pretrain"), nproc=layout.ranks)


def _run(loop_kind, request, tmp_path, layout: Layout, check: str, drill: str) -> tuple[dict, str]:
    """One run of ``layout`` with ``drill`` at iteration 3: it must end 0 with one skipped
    incident at iteration 3 and train every iteration after it."""
    loop = _loop(loop_kind, request, tmp_path, layout)
    env = {**guard_env(tmp_path, inject=[drill]), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = loop.run(env, *layout.flags, *CHECKS[check])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["severity"]) == (3, "skip_step", "warning"), incident
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and "number of skipped iterations:   1" in logged[3]
    return incident, output


def _local_nan(loop_kind, request, tmp_path, name: str, check: str) -> None:
    layout = LAYOUTS[name]
    param = f"decoder.layers.{layout.layer}.mlp.linear_fc1.weight"
    incident, _ = _run(loop_kind, request, tmp_path, layout, check, f"nan:step=3,rank=1,phase=local,param={param}")
    assert incident["origin_ranks"] == [1]
    assert incident["first"]["name"] == param and incident["first"]["layer"] == layout.layer
    ranks = incident["first"]["ranks"]
    assert ranks["global"] == 1 and all(ranks[key] == value for key, value in layout.expected_ranks), ranks


def _forward_nan(loop_kind, request, tmp_path, name: str, check: str) -> None:
    layout = LAYOUTS[name]
    module = f"decoder.layers.{layout.layer}.mlp"
    incident, _ = _run(loop_kind, request, tmp_path, layout, check, f"nan:step=3,rank=1,phase=forward,module={module}")
    assert incident["forward_origin"] == {"module": module, "layer": layout.layer, "ranks": [1]}, incident


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_forward_nan_is_named_at_its_module_and_rank_with_megatrons_check_off(loop_kind, request, tmp_path, name):
    _forward_nan(loop_kind, request, tmp_path, name, "guard_owns")


@pytest.mark.slow
@pytest.mark.layout_matrix
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_matrix_local_nan(loop_kind, request, tmp_path, name, check):
    _local_nan(loop_kind, request, tmp_path, name, check)


@pytest.mark.slow
@pytest.mark.layout_matrix
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_matrix_forward_nan_with_megatrons_check_on(loop_kind, request, tmp_path, name):
    _forward_nan(loop_kind, request, tmp_path, name, "stock")


ROLLBACK_LAYOUTS = sorted(LAYOUTS)


def _rollback(loop_kind, request, tmp_path, monkeypatch, name: str, check: str) -> None:
    """Rank 1's own gradient NaN at iterations 4 and 5: a skip, then a rollback (exit 84, recovery
    mode ``restart``); the launcher's second attempt resumes from the checkpoint of iteration 2
    (certified by the clean check of 3), trains 3, skips 4-5 through Megatron's dummy_train_step
    and trains 6."""
    layout = LAYOUTS[name]
    loop = _loop(loop_kind, request, tmp_path, layout)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # guard_env copies the environment
    param = f"decoder.layers.{layout.layer}.mlp.linear_fc1.weight"
    first, second = rollback_run(loop, tmp_path, f"nan:step=4,count=2,rank=1,phase=local,param={param}",
                                 *layout.flags, *CHECKS[check], config={"recovery": {"mode": "restart"}})
    found = incidents(tmp_path)
    assert [(i["step"], i["severity"], i["action"]) for i in found] == [(4, "warning", "skip_step"),
                                                                        (5, "error", "rollback")], found
    assert all(i["origin_ranks"] == [1] for i in found)
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]


def test_an_interleaved_pipeline_resumes_past_the_iterations_a_rollback_skips(loop_kind, request, tmp_path,
                                                                             monkeypatch):
    """PP2 x VPP2: the restart skips iterations 3-4 through Megatron's dummy_train_step, whose
    data iterator is then a list per virtual stage; megatron-core 0.19.2 cannot drain a list
    ("'list' object is not an iterator", the resumed job died) and the guard drains each stage's."""
    _rollback(loop_kind, request, tmp_path, monkeypatch, "pp2_vpp", "stock")


@pytest.mark.slow
@pytest.mark.layout_matrix
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", ROLLBACK_LAYOUTS)
def test_matrix_persistent_nan_is_rolled_back_and_resumed(loop_kind, request, tmp_path, monkeypatch, name, check):
    _rollback(loop_kind, request, tmp_path, monkeypatch, name, check)


def test_a_tensor_parallel_job_resumes_past_the_iterations_a_rollback_skips(loop_kind, request, tmp_path,
                                                                            monkeypatch):
    """TP2: on the restart Megatron's dummy_train_step reads each skipped batch on tensor-parallel
    rank 0 and broadcasts it to rank 1. The runner reads and broadcasts the same way in its own
    steps (megatron_patches/testing/gpt_loop.get_batch, as pretrain_gpt.py does): the broadcast finds
    its partner, the job resumes and completes. With every TP rank reading its own data it died
    here ("Received data size doesn't match expected size", gloo)."""
    _rollback(loop_kind, request, tmp_path, monkeypatch, "tp2", "stock")


IN_PROCESS = {"recovery": {"mode": "in_process", "lr_factor": 1, "blacklist": "deterministic", "snapshot_interval": 2}}


@pytest.mark.skipif(not _packaged_loop_available(), reason="megatron-core ships megatron/training from 0.17 on")
def test_a_tensor_parallel_rollback_in_process_redoes_the_iterations_on_the_batches_they_read(tmp_path):
    """TP2, the packaged loop, 8 iterations, rank 1's fc1 gradient NaN at 5 and 6: a skip, then a
    rollback in the same processes to the snapshot of iteration 2 (certified by the clean check of
    3). Tensor-parallel rank 1 has no data iterator (it receives each batch by broadcast), which
    the batch tape allows: the redone iterations 3 and 4 log the losses they logged the first time,
    and the job completes without a restart."""
    env = {**guard_env(tmp_path, inject=["nan:step=5,count=2,rank=1,phase=local,"
                                         "param=decoder.layers.1.mlp.linear_fc1.weight"], **IN_PROCESS),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    ckpt = tmp_path / "ckpt"
    code, output = run_packaged_loop(env, [*TINY, *TP2, "--train-iters", "8", "--save", str(ckpt), "--load", str(ckpt),
                                           "--save-interval", "100"])
    assert code == 0, output[-6000:]
    assert "stopping with exit code" not in output
    found = incidents(tmp_path)
    assert [(i["step"], i["action"]) for i in found] == [(5, "skip_step"), (6, "rollback")]
    assert found[1]["rolled_back_to"] == 2 and found[1]["checkpoint"] == "in-memory snapshot"
    first = {}  # Megatron's own line of each iteration, the first time (a redone one is logged by the guard)
    for line in output.splitlines():
        if (m := ITERATION_LINE.search(line)) and "redone" not in line and int(m.group(1)) in (3, 4):
            first.setdefault(int(m.group(1)), re.search(r"lm loss: ([^ |]+)", line).group(1))
    redone = {int(i): loss for i, loss in REDONE.findall(output)}
    assert sorted(redone) == [3, 4, 5, 6] and {i: redone[i] for i in (3, 4)} == first, (first, redone)
    assert sorted(iterations(output)) == list(range(1, 9))
