"""The optimizer and parallelism variants of issue 24 through Megatron-LM's packaged loop (0.17+), two
CPU ranks: each one guarded, with the promises of the dense data-parallel path.

Per variant: a NaN in the gradient the optimizer applies is named with its ranks, its step leaves
the weights and the optimizer state untouched bit for bit (measured by
:mod:`megatron_patches.testing.step_probe` on every rank) and the steps after it train; a persistent
fault is rolled back to the healthy checkpoint and the job resumes. Guard on versus guard off bit
for bit: tests/test_served_norm.py.

Stand-ins, named: the precision-aware optimizer needs Transformer Engine's ``FusedAdam`` (CUDA);
here :class:`megatron_patches.testing.fused_adam.StandInFusedAdam` takes its place.
"""

from __future__ import annotations

import re

import pytest

from megatron_patches.testing import step_probe
from test_megatron_lm import FC1, Loop, _packaged_loop_available, guard_env, incidents, iterations, rollback_run

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not _packaged_loop_available(),
                                 reason="the installed megatron-core ships no megatron/training (0.17+ does)")]

PRECISION_AWARE = ("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer")
BF16_STATES = ("--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
VARIANTS = {
    "precision_aware": PRECISION_AWARE,
    "precision_aware_bf16_states": (*PRECISION_AWARE, *BF16_STATES),
}


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


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_nan_the_optimizer_would_apply_is_named_and_its_step_leaves_weights_and_state_untouched(tmp_path, name):
    """Under the precision-aware optimizer the optimizer applies the shards' ``decoupled_grad`` (the
    fp32 or bf16 main gradient beside a bf16 parameter shard, ``.grad`` None): the drill writes the
    NaN there, on rank 0's shard of fc1."""
    env = {**guard_env(tmp_path, inject=[f"nan:step=3,rank=0,phase=grad,param={FC1}"]),
           step_probe.ENV: str(tmp_path / "probe"), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = Loop(None).run(env, *VARIANTS[name])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["kind"]) == (3, "skip_step", "nan"), incident
    first = incident["first"]
    assert (first["name"], first["layer"], first["shard"], first["nan"]) == (FC1, 1, True, 1), first
    assert first["ranks"]["global"] == 0 and first["ranks"]["dp"] == 0
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and "number of skipped iterations:   1" in logged[3]
    assert_only_the_skipped_steps_left_everything_untouched(tmp_path / "probe", skipped={3}, last=6)


def test_precision_aware_persistent_nan_is_rolled_back_to_its_checkpoint_and_resumed(tmp_path, monkeypatch):
    """bf16 moments and main gradients: Megatron saves them through the optimizer's
    ``get_unscaled_state`` and loads them with ``set_scaled_state`` (torch_dist format)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    first, second = rollback_run(Loop(None), tmp_path, f"nan:step=3,count=2,rank=1,phase=local,param={FC1}",
                                 *VARIANTS["precision_aware_bf16_states"])
    found = incidents(tmp_path)
    assert [(i["step"], i["severity"], i["action"]) for i in found] == [(3, "warning", "skip_step"),
                                                                        (4, "error", "rollback")], found
    assert all(i["origin_ranks"] == [1] and i["first"]["name"] == FC1 for i in found)
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [5, 6]
