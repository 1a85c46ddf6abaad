"""Optimizer and parallelism variants: each one checked, or refused at start in one line.

The refusal functions are tested here directly (fast); the packaged Megatron-LM loop tests in
tests/trainings/test_megatron_lm_refusals.py and test_megatron_lm_parallel.py run real jobs that are refused, or checked
(interleaved pipeline).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_patches import variants
from megatron_patches.errors import UnsupportedConfig, UserError


def megatron_args(**flags) -> SimpleNamespace:
    """The attributes of Megatron-LM's parsed arguments the refusal reads, stock values."""
    stock = dict(use_precision_aware_optimizer=False, optimizer_cpu_offload=False, use_megatron_fsdp=False,
                 use_torch_fsdp2=False, expert_model_parallel_size=1, context_parallel_size=1,
                 virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=False)
    return SimpleNamespace(**{**stock, **flags})


@pytest.mark.parametrize("flags, flag", [
    ({"num_experts": 4, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "flex"},
     "--moe-token-dispatcher-type flex"),
])
def test_each_unchecked_variant_is_refused_in_one_line_naming_its_flag(flags, flag):
    with pytest.raises(UnsupportedConfig) as caught:
        variants.refuse_args(megatron_args(**flags))
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert message.startswith(f"{flag} is not supported by megatron_patches yet")


@pytest.mark.parametrize("name", variants.HIGH_AVAILABILITY_ARGS)
def test_mindspeed_llm_high_availability_is_refused_by_name_with_the_reason(name):
    # MindSpeed-LLM's MindIO TTP arguments (its HIGH_AVAILABILITY environment variable sets them too).
    flag = "--" + name.replace("_", "-")
    with pytest.raises(UnsupportedConfig) as caught:
        variants.refuse_args(megatron_args(**{name: True, "use_distributed_optimizer": True}))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{flag} is not supported by megatron_patches yet")
    assert "several ranks" in message and "latest_checkpointed_iteration.txt" in message
    assert message.endswith(f"run without {flag}, or without the guard")


def test_the_no_replica_option_alone_changes_nothing_and_passes():
    # --distributed-optimizer-no-replica only acts under --enable-high-availability (refused above).
    variants.refuse_args(megatron_args(distributed_optimizer_no_replica=True, use_distributed_optimizer=True))


@pytest.mark.parametrize("flags", [
    {}, {"use_distributed_optimizer": True}, {"virtual_pipeline_model_parallel_size": 2},
    {"expert_model_parallel_size": None, "context_parallel_size": None},  # argparse defaults of old lines
    {"num_experts": 4, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall",
     "expert_tensor_parallel_size": 1},  # MoE with expert parallelism: checked (docs/moe.md)
    {"num_experts": 4, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"},
    {"num_experts": 4, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall",
     "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2},  # experts split over TP ranks (ETP)
    {"context_parallel_size": 2},  # tests/trainings/test_variant_loops.py
    {"use_precision_aware_optimizer": True, "use_distributed_optimizer": True},
    {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True, "use_distributed_optimizer": True},
    {"use_torch_fsdp2": True}, {"use_megatron_fsdp": True, "use_distributed_optimizer": True},
])
def test_checked_variants_pass(flags):
    variants.refuse_args(megatron_args(**flags))


def test_precision_aware_leaves_pair_the_bf16_shards_with_their_decoupled_grad():
    # Fake leaf with a distributed optimizer's group lists: the precision-aware one keeps None where
    # the fp32 shards would be and steps the bf16 shards, whose gradient is decoupled_grad.
    from megatron_patches.seams import optimizer_params

    model, shard = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), torch.ones(2, dtype=torch.bfloat16)
    shard.decoupled_grad = torch.full((2,), 3.0)
    leaf = SimpleNamespace(optimizer=object(), model_float16_groups=[[model]], shard_float16_groups=[[shard]],
                           shard_fp32_from_float16_groups=[[None]], model_fp32_groups=[[]], shard_fp32_groups=[[]],
                           config=SimpleNamespace(use_precision_aware_optimizer=True,
                                                  use_precision_aware_optimizer_no_fp8_or_ds_fp8=True))
    assert list(optimizer_params.param_pairs(leaf)) == [(shard, model, True)]
    assert optimizer_params.optimizer_grad(shard, optimizer_params.uses_decoupled_grad(leaf)) is shard.decoupled_grad


def test_the_stand_in_fused_adam_takes_adamw_steps_with_fp32_master_weights_over_bf16_params():
    # megatron_patches.testing.fused_adam: Transformer Engine's FusedAdam cannot run on CPU.
    from megatron_patches.testing.fused_adam import StandInFusedAdam

    torch.manual_seed(0)
    start, grads = torch.randn(64), [torch.randn(64) for _ in range(5)]
    reference = torch.nn.Parameter(start.clone())
    adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    bf16 = torch.nn.Parameter(start.to(torch.bfloat16))
    stand_in = StandInFusedAdam([bf16], lr=1e-2, weight_decay=0.1, adam_w_mode=True, master_weights=True,
                                use_decoupled_grad=True)
    for grad in grads:
        reference.grad, bf16.decoupled_grad = grad.clone(), grad.clone()
        adamw.step()
        stand_in.step()
    master = stand_in.get_unscaled_state(bf16, "master_param")
    assert master.dtype == torch.float32 and float((master - start.to(torch.bfloat16).float()).abs().max()) > 0
    # Same update from a bf16 start: within bf16 rounding of the start, the rest is AdamW's.
    assert torch.allclose(master, reference.detach() + (start.to(torch.bfloat16).float() - start), atol=1e-5)
    assert torch.equal(bf16.detach(), master.to(torch.bfloat16))
    with pytest.raises(ValueError, match="exp_avg_dtype=torch.float16 needs Transformer Engine's scaled states"):
        StandInFusedAdam([bf16], exp_avg_dtype=torch.float16)


def test_megatrons_rerun_checkpoint_is_told_apart_from_an_ordinary_save():
    rsm = pytest.importorskip("megatron.core.rerun_state_machine")
    from megatron_patches.seams.megatron_lm import checkpoints as megatron_lm_checkpoints

    machine = rsm.get_rerun_state_machine()
    before = machine.state
    try:
        machine.state = rsm.RerunState.NOT_RUNNING_YET
        assert megatron_lm_checkpoints._rerun_checkpoint() is None
        machine.state = rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
        assert "WILL_RERUN_FROM_CHECKPOINT" in megatron_lm_checkpoints._rerun_checkpoint()
    finally:
        machine.state = before


# --- checkpoint kinds (the session's save hooks, on a real megatron.training) -------------------


@pytest.fixture
def megatron_training(monkeypatch, tmp_path):
    """megatron.training's get_args pointed at a namespace with --save (0.17+ ships the package)."""
    training = pytest.importorskip("megatron.training", reason="megatron-core ships megatron/training from 0.17 on")
    args = SimpleNamespace(save=str(tmp_path), async_save=False)
    monkeypatch.setattr(training, "get_args", lambda: args)
    return args


def _session():
    from megatron_patches.seams import megatron_lm

    from megatron_patches.config import Config

    added, counters = [], {"incidents": 0}
    state = SimpleNamespace(config=Config(), counters=counters, detectors=[])  # the RunState parts the marks read
    monitor = SimpleNamespace(counters=counters, state=state, state_dict=dict, add_callback=added.append, added=added)
    return megatron_lm.MegatronLMSession(monitor)


def _marker(root, iteration):
    from megatron_patches import checkpoint

    path = os.path.join(checkpoint.checkpoint_dir(str(root), iteration), checkpoint.MARKER)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _saved(root, iteration):
    from megatron_patches import checkpoint

    os.makedirs(checkpoint.checkpoint_dir(str(root), iteration))


def test_megatrons_rerun_checkpoint_is_marked_not_healthy(megatron_training, tmp_path):
    rsm = pytest.importorskip("megatron.core.rerun_state_machine")
    machine, session = rsm.get_rerun_state_machine(), _session()
    before = machine.state
    _saved(tmp_path, 2)
    _saved(tmp_path, 3)
    try:
        session.after_save(2, [torch.nn.Linear(2, 2)], non_persistent=False)
        machine.state = rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT  # saved before Megatron exits 17
        session.after_save(3, [torch.nn.Linear(2, 2)], non_persistent=False)
    finally:
        machine.state = before
    assert _marker(tmp_path, 2)["healthy"] is True
    assert _marker(tmp_path, 3)["healthy"] is False and "rerun state machine" in _marker(tmp_path, 3)["rerun"]


def test_async_save_is_marked_only_once_finalized_and_finalized_before_the_guards_exit_no_async_worker_on_cpu(
        megatron_training, monkeypatch, tmp_path):
    # Megatron's async worker needs CUDA (0.19 disables --async-save without the persistent
    # worker, which sets a CUDA device): its queue is replaced by a flag here.
    from megatron.training import async_utils

    pending = {"saves": 1}
    finalized = []
    monkeypatch.setattr(async_utils, "is_empty_async_queue", lambda: pending["saves"] == 0)

    def finalize(blocking=False, terminate=False):
        finalized.append(blocking)
        pending["saves"] = 0

    monkeypatch.setattr(async_utils, "maybe_finalize_async_save", finalize)
    megatron_training.async_save = True
    session = _session()
    _saved(tmp_path, 4)
    session.after_save(4, [torch.nn.Linear(2, 2)], non_persistent=False)
    assert _marker(tmp_path, 4) is None  # the save is still being written
    for callback in session.monitor.added:  # what the guard's exit runs first: its callbacks' before_exit
        callback.before_exit(None)
    assert finalized == [True]
    assert _marker(tmp_path, 4)["healthy"] is True
