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

from megatron_patches.seams.mindspeed import converted_by_prepare, undo_prepare_on_skip

KINDS = ("float16", "distributed", "distributed-dp2")
"""Float16OptimizerWithFloat16Params and DistributedOptimizer on one rank; DistributedOptimizer on
two data-parallel ranks (gloo, under torchrun), where MindSpeed keeps each rank's fp32 shard inside
the neighbouring shard of the bf16 parameter buffer."""


@pytest.fixture(scope="module")
def mindspeed_dir() -> Path:
    from conftest import source_tree  # here: this file also runs as a script (the scenarios)

    return source_tree("MINDSPEED_DIR", "mindspeed/core/memory/reuse_param/adaptor.py",
                       "a MindSpeed source tree (e.g. tag v26.0.0_core_r0.12.1)")


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


# --- install order and survival beside MindSpeed's patch manager (in this process) ---------------
# mindspeed/patch_utils.py is plain Python: its MindSpeedPatchesManager is imported from MINDSPEED_DIR
# and run against the installed megatron-core. The functions it patches in with are the tests' own
# (MindSpeed's real replacements need torch_npu); the capture, replacement, removal and reapplication
# are MindSpeed's.

_MPO = "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.prepare_grads"


@pytest.fixture
def ms_manager(mindspeed_dir, monkeypatch):
    """A function importing MindSpeed's patch manager (sys.path holds MINDSPEED_DIR already, so that
    ``import mindspeed`` works as in a job); afterwards its patches, ours and its modules are gone."""
    from megatron_patches.seams import patching
    from megatron_patches import runtime
    from megatron_patches.seams.targets import TARGETS

    runtime.uninstall()
    owners = [patching._resolve(t.module, t.qualname) for t in TARGETS]
    before = [(owner, name, patching._current(owner, name)) for owner, name in owners]
    monkeypatch.syspath_prepend(str(mindspeed_dir))
    imported = []

    def load():
        from mindspeed.patch_utils import MindSpeedPatchesManager

        imported.append(MindSpeedPatchesManager)
        return MindSpeedPatchesManager

    yield load
    runtime.uninstall()
    for manager in imported:
        manager.remove_patches()
        manager.patches_info.clear()
    runtime.uninstall()
    for owner, name, value in before:  # whatever the removals above put back
        setattr(owner, name, value)
    for name in [m for m in sys.modules if m == "mindspeed" or m.startswith("mindspeed.")]:
        del sys.modules[name]


@pytest.fixture
def hook_calls(monkeypatch):
    """Optimizers our prepare_grads hook saw (the hook's check itself needs a monitor)."""
    from megatron_patches.seams import wrappers

    seen = []
    monkeypatch.setattr(wrappers, "_checked_prepare", lambda instance, call: (seen.append(instance), call())[1])
    return seen


def _mpo_installed():
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    return MixedPrecisionOptimizer.__dict__["prepare_grads"]


def _layers_of_ours(obj) -> int:
    from megatron_patches.seams import patching

    count = 0
    while obj is not None:
        count += patching._our_wrapper(obj) is not None
        obj = getattr(obj, "__wrapped__", None)
    return count


class _Optimizer:  # the instance our hook is handed; a ChainedOptimizer with no leaves
    chained_optimizers: list = []


def _prepare_grads_of(cls, optimizer):
    """``optimizer.prepare_grads()`` with the method ``cls`` holds (bound as an instance would)."""
    return cls.__dict__["prepare_grads"].__get__(optimizer, cls)()


def _replacement_prepare_grads(self):  # stands for MindSpeed's replacement (e.g. reuse-fp32-param's)
    return False


@pytest.mark.mindspeed
def test_guard_before_mindspeed_is_said_and_wrapped_again(ms_manager, hook_calls, caplog):
    """Wrong order: our install names the order; MindSpeed's replacement of prepare_grads drops our
    wrapper; the first call of one of ours says so and wraps the replacement, and the hook fires."""
    import logging

    from megatron.core.optimizer.optimizer import ChainedOptimizer, MixedPrecisionOptimizer

    from megatron_patches.seams import patching

    with caplog.at_level(logging.WARNING, logger="megatron_patches"):
        patching.install()
    order = [r.message for r in caplog.records
             if "mindspeed.megatron_adaptor before megatron_patches.apply" in r.message]
    assert len(order) == 1, caplog.records

    manager = ms_manager()  # imported after us, as an adaptor imported after megatron_patches.apply
    manager.register_patch(_MPO, _replacement_prepare_grads)
    manager.apply_patches()
    assert _mpo_installed() is _replacement_prepare_grads
    assert patching.replaced_targets() == [_MPO]

    caplog.clear()
    chained = _Optimizer()
    with caplog.at_level(logging.WARNING, logger="megatron_patches"):
        _prepare_grads_of(ChainedOptimizer, chained)  # any first call of ours checks
    said = [r.message for r in caplog.records if "wrapped again" in r.message]
    assert len(said) == 1 and "MixedPrecisionOptimizer.prepare_grads" in said[0] and "mindspeed" in said[0].lower()
    assert patching.replaced_targets() == []
    assert _mpo_installed().__wrapped__ is _replacement_prepare_grads
    leaf = _Optimizer()
    assert _prepare_grads_of(MixedPrecisionOptimizer, leaf) is False
    assert hook_calls == [chained, leaf]


@pytest.mark.mindspeed
def test_repatch_keeps_the_guard(ms_manager, hook_calls, caplog):
    """Documented order, then MindSpeed's repatch() (remove every patch, apply them again): its
    replacement is put back over ours, and ours is wrapped around it again at once, said in one line."""
    import logging

    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    from megatron_patches.seams import patching

    manager = ms_manager()
    manager.register_patch(_MPO, _replacement_prepare_grads)
    manager.apply_patches()
    with caplog.at_level(logging.WARNING, logger="megatron_patches"):
        patching.install()
    assert not [r for r in caplog.records if "megatron_adaptor" in r.message]
    assert _mpo_installed().__wrapped__ is _replacement_prepare_grads

    # what mindspeed.megatron_adaptor.repatch does through MindSpeedFeaturesManager
    manager.remove_patches()
    manager.register_patch(_MPO, _replacement_prepare_grads)
    with caplog.at_level(logging.WARNING, logger="megatron_patches"):
        manager.apply_patches()
    said = [r.message for r in caplog.records if "wrapped again" in r.message]
    assert len(said) == 1 and "repatch" in said[0], caplog.records
    assert _layers_of_ours(_mpo_installed()) == 1 and _mpo_installed().__wrapped__ is _replacement_prepare_grads
    leaf = _Optimizer()
    assert _prepare_grads_of(MixedPrecisionOptimizer, leaf) is False and hook_calls == [leaf]
    # Uninstalling restores MindSpeed's replacement, not ours and not Megatron's.
    patching.uninstall()
    assert _mpo_installed() is _replacement_prepare_grads


@pytest.mark.mindspeed
def test_our_wrapper_captured_through_getattr_is_recognised(ms_manager):
    """MindSpeed captures our wrapper through getattr (a BoundFunctionWrapper) and puts that back when
    it removes its patches: a second install wraps once, and uninstall restores Megatron's function."""
    import functools

    import wrapt

    from megatron_patches.seams import patching

    original = _mpo_installed()
    manager = ms_manager()
    patching.install()

    def prepare_grads_wrapper(fn):  # a MindSpeed-style wrapper patch (the name decides; @wraps as theirs)
        @functools.wraps(fn)
        def prepare_grads(self, *args, **kwargs):
            return fn(self, *args, **kwargs)
        return prepare_grads

    manager.register_patch(_MPO, prepare_grads_wrapper)
    manager.apply_patches()
    captured = manager.patches_info[_MPO].orig_func
    assert isinstance(captured, wrapt.BoundFunctionWrapper) and patching._our_wrapper(captured) is not None
    patching.uninstall()  # MindSpeed's wrapper sits on ours: left in place, named
    manager.remove_patches()  # puts the captured BoundFunctionWrapper back on the class
    assert isinstance(_mpo_installed(), wrapt.BoundFunctionWrapper)

    patching.install()
    assert _layers_of_ours(_mpo_installed()) == 1 and _mpo_installed().__wrapped__ is original
    patching.uninstall()
    assert _mpo_installed() is original

    patching.install()  # and uninstall directly over a put-back BoundFunctionWrapper of ours
    manager.register_patch(_MPO, prepare_grads_wrapper)
    manager.apply_patches()
    manager.remove_patches()
    patching.uninstall()
    assert _mpo_installed() is original


def test_copies_bound_in_listed_modules_are_wrapped(clean_patches, monkeypatch):
    """An identity scan of the modules in BINDING_MODULES (here a stand-in module under the name of
    MindSpeed-LLM's training module) reaches copies bound under any name, and uninstall undoes it."""
    import importlib
    import types

    from megatron_patches.seams import patching
    from megatron_patches.seams import mindspeed

    fmg_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = fmg_module.finalize_model_grads
    standin_llm_training = types.ModuleType(mindspeed.BINDING_MODULES[0])
    standin_llm_training.finalize_model_grads = original
    standin_llm_training.fmg = original
    monkeypatch.setitem(sys.modules, mindspeed.BINDING_MODULES[0], standin_llm_training)
    patching.install()
    ours = fmg_module.finalize_model_grads
    assert ours is not original and patching._our_wrapper(ours) is not None
    assert standin_llm_training.finalize_model_grads is ours and standin_llm_training.fmg is ours
    patching.uninstall()
    assert standin_llm_training.finalize_model_grads is original and standin_llm_training.fmg is original


@pytest.mark.parametrize("flag", ["use_quant_optimizer", "quant_states", "quant_grads", "layerzero"])
def test_unchecked_optimizer_paths_are_refused_by_name(flag):
    import argparse

    from megatron_patches.errors import UnsupportedConfig
    from megatron_patches.seams.mindspeed import refuse_unchecked_paths

    refuse_unchecked_paths(argparse.Namespace(use_quant_optimizer=False, quant_states=None, layerzero=False))
    with pytest.raises(UnsupportedConfig, match=flag):
        refuse_unchecked_paths(argparse.Namespace(**{flag: "fp8" if flag == "quant_states" else True}))


def test_overflow_mode_is_asked_at_first_use_not_at_install(monkeypatch):
    """torch_npu's query initialises the current device: nothing asks it when the guard is installed;
    the first use asks it once (after Megatron's set_device in a job). The torch_npu here is a
    stand-in with the one query (torch_npu is absent on this machine)."""
    import types

    from megatron_patches.config import Config
    from megatron_patches.seams import build_monitor

    asked = []
    standin_torch_npu = types.ModuleType("torch_npu")
    standin_torch_npu.npu = types.SimpleNamespace(utils=types.SimpleNamespace(
        is_support_inf_nan=lambda: (asked.append(1), False)[1]))
    monkeypatch.setitem(sys.modules, "torch_npu", standin_torch_npu)
    monitor = build_monitor(Config.from_dict({}))  # what import megatron_patches.apply makes
    assert asked == []
    assert monitor.overflow_mode == "saturation" and monitor.overflow_mode == "saturation"
    assert asked == [1]
    assert build_monitor(Config.from_dict({"overflow_mode": "ieee"})).overflow_mode == "ieee" and asked == [1]


def test_overflow_mode_without_torch_npu_is_ieee(monkeypatch):
    from megatron_patches.config import Config
    from megatron_patches.seams import build_monitor

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert build_monitor(Config.from_dict({})).overflow_mode == "ieee"


def _gather_on_rank(rank: int, port: int, out: str) -> None:
    import torch

    from megatron_patches.collectives import all_gather_floats

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    every = all_gather_floats([1.0 / 3 + rank, 1e-9 * (rank + 1)])
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    torch.distributed.destroy_process_group()


def test_float_gather_keeps_float64_precision_in_float32_tensors(tmp_path):
    """The guard sends no float64 tensor (MindSpeed's float64 all_reduce shim drops the result); the
    harness's mean loss still arrives at float64 precision (to ~2**-48) on two gloo ranks."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "every.json"
    mp.spawn(_gather_on_rank, args=(port, str(out)), nprocs=2)
    every = json.loads(out.read_text())
    expected = [[1.0 / 3, 1e-9], [1.0 / 3 + 1, 2e-9]]
    for got, want in zip(every, expected):
        assert got == pytest.approx(want, rel=2.0 ** -46, abs=0)
        assert got[0] != torch.tensor(want[0], dtype=torch.float32).item()  # finer than float32


# --- the scenario, run in a fresh process: python tests/trainings/test_mindspeed.py DIR KIND OUT RESULT -------


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

    from megatron_patches.seams import wrappers
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
        monitor = wrappers.get_monitor()
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

    from megatron_patches.seams import MegatronSeams

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
        # Ours after MindSpeed's, as in a pretrain_gpt.py that imports mindspeed.megatron_adaptor first.
        runtime.uninstall()
        monitor = runtime.install(Config.from_dict({"report_dir": os.path.join(out, f"{kind}-{variant}")}))
        model, optimizer = build()
        leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        # 0.16.1 always returns a ChainedOptimizer; "lone" steps its leaf as 0.12.1 does with one.
        stepped = leaves[0] if variant == "lone" else optimizer
        # The undo is switched where the running code looks it up, not where it is defined: the skip
        # hook calls wrappers' own name (a ``from .mindspeed import``), the scaler's skip calls the
        # monitor's seams (MegatronSeams' staticmethod, bound at import).
        with pytest.MonkeyPatch.context() as patch:
            if variant in undo_for:
                patch.setattr(wrappers, "undo_prepare_on_skip", undo_for[variant])
                patch.setattr(MegatronSeams, "undo_prepare_on_skip", staticmethod(undo_for[variant]))
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
    runtime.uninstall()
    return result


if __name__ == "__main__":
    directory, which, out_dir, result_path = sys.argv[1:5]
    outcome = _scenario(directory, which, out_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(result_path).write_text(json.dumps(outcome, indent=1))
