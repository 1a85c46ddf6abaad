"""The guard's skipped step under MindSpeed's ``--reuse-fp32-param`` (Ascend's Megatron adaptor).

MindSpeed's ``prepare_grads`` turns the bf16 weights into fp32 master weights in place and only its
``step_with_ready_grads`` turns them back; when our guard skips the step, Megatron's ``step()``
returns in between. These tests apply MindSpeed's own feature (``ReuseFP32Param.register_patches``
through its ``MindSpeedPatchesManager``) to megatron-core on CPU, train a tiny bf16 GPT, put a NaN
into one gradient, and compare the bf16 weights bit for bit.

What is not MindSpeed's code, and why:

- ``reuse_data_ptr`` is MindSpeed's C++ op (``mindspeed/ops/csrc/algorithm/algorithm.cpp``); its
  builder needs the Ascend toolchain, so the same source file is compiled here with
  ``torch.utils.cpp_extension`` for the CPU and handed out by a stand-in ``mindspeed.op_builder``.
- ``torch_npu`` is imported by MindSpeed's adaptor for ``torch_npu.npu.empty_cache()`` only: a
  stand-in module (``fake_torch_npu_standin``) provides that call.
- ``megatron.training.get_args`` (Megatron-LM's, not in the megatron-core package) is a stand-in
  returning the arguments a ``--bf16 --reuse-fp32-param`` run has, present only while MindSpeed's
  modules are imported.
- ``mindspeed.features_manager`` is loaded without its ``__init__`` (which imports every feature of
  MindSpeed, most of them needing torch_npu); the feature file and its base class are MindSpeed's.

MindSpeed's release targets megatron-core 0.12.1; this runs it against the installed 0.16.1, whose
optimizer attributes it uses are unchanged. Each optimizer kind runs in a fresh process (two under
torchrun for the data-parallel case), since the patches are process-wide; compiling the op takes
about half a minute the first time (cached in $TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patches.integrations.mindspeed import converted_by_prepare, undo_prepare_on_skip

KINDS = ("float16", "distributed", "distributed-dp2")
"""Float16OptimizerWithFloat16Params and DistributedOptimizer on one rank; DistributedOptimizer on
two data-parallel ranks (gloo, under torchrun), where MindSpeed keeps each rank's fp32 shard inside
the neighbouring shard of the bf16 parameter buffer."""


@pytest.fixture(scope="module")
def mindspeed_dir() -> Path:
    value = os.environ.get("MINDSPEED_DIR")
    if not value:
        pytest.skip("MINDSPEED_DIR not set: point it at a MindSpeed source tree (e.g. tag v26.0.0_core_r0.12.1)")
    path = Path(value)
    if not (path / "mindspeed" / "core" / "memory" / "reuse_param" / "adaptor.py").is_file():
        pytest.skip(f"MINDSPEED_DIR={value} has no mindspeed/core/memory/reuse_param/adaptor.py")
    return path


@pytest.fixture(scope="module")
def runs(mindspeed_dir, tmp_path_factory) -> dict:
    """Per kind, one process (or two under torchrun) running: the fix ("fixed"), the undo switched off
    ("unfixed"), clean steps only ("reference"), the leaf stepped without a chain ("lone") and, with
    two ranks, the undo without its all-gather ("no_gather")."""
    out = tmp_path_factory.mktemp("mindspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    results = {}
    for kind in KINDS:
        result = out / f"{kind}.json"
        launch = [sys.executable]
        if kind.endswith("dp2"):
            launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        proc = subprocess.run([*launch, __file__, str(mindspeed_dir), kind, str(out), str(result)],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        results[kind] = json.loads(result.read_text())
    return results


@pytest.mark.mindspeed
@pytest.mark.parametrize("kind", KINDS)
def test_mindspeed_patch_is_what_runs(runs, kind):
    """MindSpeed's prepare_grads is the one our wrapper calls, and the optimizer is converted by it."""
    run = runs[kind]["fixed"]
    assert run["prepare_grads_from"] == "mindspeed.core.memory.reuse_param.adaptor"
    assert run["optimizer_class"] == ("DistributedOptimizer" if kind.startswith("distributed")
                                      else "Float16OptimizerWithFloat16Params")
    assert run["reuse_detected"]


@pytest.mark.mindspeed
@pytest.mark.parametrize("kind", KINDS)
def test_skipped_step_restores_bf16_weights_bit_for_bit(runs, kind):
    """A NaN gradient on the first step and again after a clean one: both steps are skipped, the
    bf16 weights are bit-identical to before each, and the clean steps after them train."""
    run = runs[kind]["fixed"]
    assert run["skipped_steps"] == 2, run
    for event in run["events"]:
        if event["nan"]:
            assert event["skipped"] and event["bit_identical"], event
        else:
            assert not event["skipped"] and event["finite"] and event["changed"], event
        assert event["loss_finite"], event
    # The clean steps around the skips end exactly where the same clean steps alone do.
    reference = runs[kind]["reference"]["events"]
    assert [e["weights"] for e in run["events"] if not e["nan"]] == [e["weights"] for e in reference]
    # The same with the leaf optimizer stepped directly (no ChainedOptimizer around it).
    lone = runs[kind]["lone"]["events"]
    assert lone[0]["skipped"] and lone[0]["bit_identical"] and not lone[1]["skipped"], lone
    assert lone[1]["weights"] == reference[0]["weights"]


@pytest.mark.mindspeed
@pytest.mark.parametrize("kind", KINDS)
def test_without_the_undo_the_weights_are_wrong(runs, kind):
    """The same run with the undo switched off: the skipped step leaves the fp32 layout behind,
    so the bf16 weights the next forward reads are not the ones before the step."""
    run = runs[kind]["unfixed"]
    nan_events = [e for e in run["events"] if e["nan"]]
    assert nan_events and all(e["skipped"] for e in nan_events)
    assert not any(e["bit_identical"] for e in nan_events), nan_events


@pytest.mark.mindspeed
def test_with_two_ranks_the_conversion_alone_is_not_enough(runs):
    """With data parallelism, converting back restores only each rank's own shard: the parameter
    all-gather that step_with_ready_grads would run is needed too."""
    nan_events = [e for e in runs["distributed-dp2"]["no_gather"]["events"] if e["nan"]]
    assert nan_events and all(e["skipped"] for e in nan_events)
    assert not any(e["bit_identical"] for e in nan_events), nan_events


def test_without_mindspeed_nothing_happens():
    """Plain optimizers (no MindSpeed attributes) are left alone, chained or not."""

    class Config:
        reuse_fp32_param = False

    class Plain:
        config = Config()

        def fp32_tensor_convert_to_fp16_tensor(self):  # present but the flag is off
            raise AssertionError("must not be called")

    class Chain:
        chained_optimizers = [Plain(), object()]

    assert not converted_by_prepare(object())
    assert not undo_prepare_on_skip(object())
    assert not undo_prepare_on_skip(Plain())
    assert not undo_prepare_on_skip(Chain())


# --- the scenario, run in a fresh process: python tests/test_mindspeed.py DIR KIND OUT RESULT -------


def _stand_ins(mindspeed_dir: str, kind: str):
    """Install the stand-ins described in the module docstring; returns a function removing the
    megatron.training one (it must not be there when our own patches install)."""
    import argparse
    import types

    import megatron
    from torch.utils.cpp_extension import load

    sys.path.insert(0, mindspeed_dir)
    import mindspeed  # noqa: F401  (the real package, from MINDSPEED_DIR)

    fake_torch_npu_standin = types.ModuleType("torch_npu")
    fake_torch_npu_standin.__doc__ = "stand-in: MindSpeed's adaptor only calls torch_npu.npu.empty_cache()"
    fake_torch_npu_standin.npu = types.SimpleNamespace(empty_cache=lambda: None)
    sys.modules["torch_npu"] = fake_torch_npu_standin

    algorithm = load(name="mindspeed_algorithm_cpu", verbose=False,
                     sources=[os.path.join(mindspeed_dir, "mindspeed/ops/csrc/algorithm/algorithm.cpp")])

    class AlgorithmOpBuilder:  # stand-in for the Ascend builder: MindSpeed's own op, built for CPU
        def load(self):
            return algorithm

    op_builder_standin = types.ModuleType("mindspeed.op_builder")
    op_builder_standin.AlgorithmOpBuilder = AlgorithmOpBuilder
    sys.modules["mindspeed.op_builder"] = op_builder_standin

    features = types.ModuleType("mindspeed.features_manager")  # the package without its __init__
    features.__path__ = [os.path.join(mindspeed_dir, "mindspeed", "features_manager")]
    sys.modules["mindspeed.features_manager"] = features

    args = argparse.Namespace(
        reuse_fp32_param=True, bf16=True, npu_deterministic=False, disable_gloo_group=False,
        use_distributed_optimizer=kind.startswith("distributed"), optimizer_selection="adam",
        enable_zero3=False, use_quant_optimizer=False, param_and_grad_buffer_pad=None,
        use_legacy_models=False, overlap_param_gather=False)
    training_standin = types.ModuleType("megatron.training")
    training_standin.get_args = lambda: args
    sys.modules["megatron.training"] = training_standin
    megatron.training = training_standin

    def remove_training_standin():
        del sys.modules["megatron.training"]
        del megatron.training

    return args, remove_training_standin


def _scenario(mindspeed_dir: str, kind: str, out: str) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    import torch

    if "RANK" in os.environ:  # under torchrun
        torch.distributed.init_process_group("gloo")
    else:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron_patches.testing import cpu

    cpu.install()
    args, remove_training_standin = _stand_ins(mindspeed_dir, kind)

    from mindspeed.features_manager.memory.reuse_fp32_param import ReuseFP32Param
    from mindspeed.patch_utils import MindSpeedPatchesManager

    ReuseFP32Param().register_patches(MindSpeedPatchesManager, args)
    MindSpeedPatchesManager.apply_patches()
    remove_training_standin()

    from megatron_patches import runtime
    from megatron_patches.config import Config


    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(1, 1)
    distributed = kind.startswith("distributed")
    vocab, seq = 64, 16

    def build():
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, gradient_accumulation_fusion=False, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
            apply_rope_fusion=False)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=vocab, max_sequence_length=seq)
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
            Float16Module(config, model))
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, bf16=True,
                            use_distributed_optimizer=distributed), [model])
        return model, optimizer

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=generator)
    position_ids = torch.arange(seq).unsqueeze(0).expand(2, seq)

    def bf16_bits(model):
        return [p.detach().view(torch.int16).clone() for p in model.parameters()]

    def step(model, optimizer, nan: bool) -> dict:
        before = bf16_bits(model)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        if nan:
            next(p for p in model.parameters() if p.requires_grad).main_grad.view(-1)[0] = float("nan")
        monitor = runtime.active_monitor()
        skipped_before = monitor.counters["skipped_steps"]
        optimizer.step()
        after = bf16_bits(model)
        with torch.no_grad():
            next_loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        event = {
            "skipped": monitor.counters["skipped_steps"] > skipped_before,
            "bit_identical": all(torch.equal(a, b) for a, b in zip(before, after)),
            "changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "loss_finite": bool(torch.isfinite(next_loss)),
        }
        # True only where it holds on every rank (each rank compares its full set of weights).
        flags = torch.tensor([int(v) for v in event.values()])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
        event = dict(zip(event, (bool(v) for v in flags.tolist())))
        digest = hashlib.sha256(b"".join(a.numpy().tobytes() for a in after)).hexdigest()
        return {"nan": nan, **event, "weights": digest}

    import megatron_patches.integrations.mindspeed as integration

    real_undo = integration.undo_prepare_on_skip

    def convert_back_only(optimizer):  # the undo without its parameter all-gather
        leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        for leaf in filter(converted_by_prepare, leaves):
            leaf.fp32_tensor_convert_to_fp16_tensor()

    undo_for = {"unfixed": lambda optimizer: False, "no_gather": convert_back_only}
    result = {}
    # Without the undo only the first skip is looked at: what follows it runs on broken weights.
    # The reference makes the clean steps alone: a skip that changes nothing leaves the same weights.
    for variant, nans in (("fixed", (True, False, True, False)), ("unfixed", (True,)),
                          ("reference", (False, False)), ("no_gather", (True,)), ("lone", (True, False))):
        if variant == "no_gather" and torch.distributed.get_world_size() == 1:
            continue
        integration.undo_prepare_on_skip = undo_for.get(variant, real_undo)
        # Ours after MindSpeed's, as in a pretrain_gpt.py that imports mindspeed.megatron_adaptor first.
        runtime.uninstall()
        monitor = runtime.install(Config.from_dict({"report_dir": os.path.join(out, f"{kind}-{variant}")}))
        model, optimizer = build()
        leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        # 0.16.1 always returns a ChainedOptimizer; "lone" steps its leaf as 0.12.1 does with one.
        stepped = leaves[0] if variant == "lone" else optimizer
        events = [step(model, stepped, nan) for nan in nans]
        prepare = MixedPrecisionOptimizer.prepare_grads
        result[variant] = {
            "events": events,
            "skipped_steps": monitor.counters["skipped_steps"],
            "optimizer_class": type(leaves[0]).__name__,
            "leaves": len(leaves),
            "reuse_detected": all(converted_by_prepare(leaf) for leaf in leaves),
            "prepare_grads_from": getattr(prepare, "__wrapped__", prepare).__module__,
        }
    integration.undo_prepare_on_skip = real_undo
    runtime.uninstall()
    return result


if __name__ == "__main__":
    directory, which, out_dir, result_path = sys.argv[1:5]
    outcome = _scenario(directory, which, out_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(result_path).write_text(json.dumps(outcome, indent=1))
