"""The patch mechanism: idempotent, reversible, refuses unsupported megatron-core."""

import importlib.util
import inspect
import logging

import pytest
import wrapt

from megatron_patches.seams import wrappers, patching
from megatron_patches import runtime, versions
from megatron_patches.config import Config
from megatron_patches.errors import UnsupportedVersionError
from megatron_patches.seams.targets import TARGETS, TRAINING_TARGETS


def _current(target):
    owner, name = patching._resolve(target.module, target.qualname)
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def test_install_twice_adds_nothing_and_uninstall_restores(clean_patches, caplog):
    originals = {t.dotted: _current(t) for t in TARGETS}
    with caplog.at_level(logging.DEBUG, logger="megatron_patches"):
        first = patching.install()
        second = patching.install()
    # Megatron-LM's training targets come on top where megatron.training is importable (0.17+ wheel).
    training = [t.dotted for t in TRAINING_TARGETS if importlib.util.find_spec(t.module.rsplit(".", 1)[0])]
    assert sorted(first) == sorted([t.dotted for t in TARGETS] + training)
    assert second == []
    assert sum("patched megatron.core.optimizer.optimizer.FP32Optimizer.prepare_grads" in r.message
               for r in caplog.records) == 1
    # At the default level one line says what was done (the per-target lines are debug).
    summary = [r.message for r in caplog.records if r.levelno >= logging.INFO]
    assert len(summary) == 1 and summary[0].startswith(f"guarding megatron-core ") and len(summary[0]) < 200
    for target in TARGETS:
        wrapped = _current(target)
        assert isinstance(wrapped, wrapt.FunctionWrapper)
        assert wrapped.__wrapped__ is originals[target.dotted]
    patching.uninstall()
    assert {t.dotted: _current(t) for t in TARGETS} == originals


def test_a_lazy_target_is_wrapped_when_its_module_is_imported_and_never_imported_by_the_install(
        clean_patches, tmp_path, monkeypatch):
    """Megatron-Bridge's targets: the install imports none of their modules (Bridge takes ~20 s and needs
    packages a Megatron-LM job lacks); a module imported after the install is wrapped as it finishes
    executing, one imported before is wrapped at once; uninstall restores both."""
    import sys

    from megatron_patches.seams.targets import PatchTarget

    for name in ("lazy_after", "lazy_before"):
        (tmp_path / f"{name}.py").write_text("def train_step(x):\n    return x + 1\n\ndef caller(x):\n"
                                             "    return train_step(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import lazy_before

    targets = tuple(PatchTarget(name, "train_step", "megatron_patches.seams.wrappers.get_optimizer_wrapper",
                                "test", required=False, lazy=True) for name in ("lazy_after", "lazy_before"))
    monkeypatch.setattr(patching, "BRIDGE_TARGETS", targets)
    try:
        done = patching.install()
        assert "lazy_after" not in sys.modules and not any("lazy" in d for d in done)
        assert isinstance(lazy_before.train_step, wrapt.FunctionWrapper)  # imported before: wrapped now
        import lazy_after

        assert isinstance(lazy_after.train_step, wrapt.FunctionWrapper)
        assert {"lazy_after.train_step", "lazy_before.train_step"} <= set(patching.installed_targets())
        patching.uninstall()
        assert not isinstance(lazy_after.train_step, wrapt.FunctionWrapper)
        assert not isinstance(lazy_before.train_step, wrapt.FunctionWrapper)
        assert not any(isinstance(f, patching._AfterImport) for f in sys.meta_path)
    finally:
        for name in ("lazy_after", "lazy_before"):
            sys.modules.pop(name, None)


def test_reexported_name_is_wrapped_too(clean_patches):
    import megatron.core.distributed as dist_pkg

    with patching.patched():
        assert isinstance(dist_pkg.finalize_model_grads, wrapt.FunctionWrapper)
    assert not isinstance(dist_pkg.finalize_model_grads, wrapt.FunctionWrapper)


def test_wrapper_keeps_signature(clean_patches):
    from megatron.core.optimizer import optimizer as opt

    before = inspect.signature(opt.MegatronOptimizer.clip_grad_norm)
    with patching.patched():
        assert inspect.signature(opt.MegatronOptimizer.clip_grad_norm) == before


def test_patch_on_top_of_ours_is_left_alone_and_named(clean_patches, caplog):
    from megatron.core.optimizer import optimizer as opt

    patching.install()
    ours = opt.FP32Optimizer.__dict__["prepare_grads"]

    def someone_else(self):
        return ours(self)

    opt.FP32Optimizer.prepare_grads = someone_else
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_patches"):
            patching.uninstall()
        assert opt.FP32Optimizer.__dict__["prepare_grads"] is someone_else
        assert any("FP32Optimizer.prepare_grads was patched again on top of ours" in r.message
                   for r in caplog.records)
    finally:
        opt.FP32Optimizer.prepare_grads = ours.__wrapped__


@pytest.mark.parametrize("version", ["0.8.0", "0.11.0", "0.21.0"])
def test_unsupported_megatron_core_is_refused(clean_patches, version):
    with pytest.raises(UnsupportedVersionError, match=f"megatron-core {version} is not supported"):
        patching.install(version=version)
    assert patching.installed_targets() == []


@pytest.mark.parametrize("version", ["0.8.0", "0.8.1"])
def test_megatron_core_0_8_is_refused_by_name_with_the_reason(clean_patches, version):
    # MindSpeed's older branches pair with 0.8: the reason, not just the supported list, in one line
    # (from make install's version check and from install()).
    with pytest.raises(UnsupportedVersionError) as caught:
        patching.install(version=version)
    for message in (str(caught.value), versions.problem(version)):
        assert "\n" not in message and message.startswith(f"megatron-core {version} is not supported")
        assert "MindSpeed" in message and "check_grads" in message and "use 0.12.1" in message
    assert patching.installed_targets() == []
    assert versions.problem("0.12.1", python=(3, 11)) is None


def test_disabled_config_installs_nothing(clean_patches):
    assert runtime.install(Config.from_dict({"enabled": False})) is None
    assert patching.installed_targets() == [] and wrappers.get_monitor() is None


def test_source_patch_decorator_is_not_wrapped_twice(clean_patches):
    from megatron.core.optimizer import optimizer as opt

    original = opt.FP32Optimizer.__dict__["prepare_grads"]
    opt.FP32Optimizer.prepare_grads = wrappers.checked_prepare_grads(original)
    try:
        names = patching.install()
        assert "megatron.core.optimizer.optimizer.FP32Optimizer.prepare_grads" not in names
        assert opt.FP32Optimizer.__dict__["prepare_grads"].__megatron_patches__ is True
    finally:
        patching.uninstall()
        opt.FP32Optimizer.prepare_grads = original


def test_readme_config_block_loads(tmp_path):
    """The YAML shown in the README is valid as printed (1.0e6 included, which PyYAML reads as a string)."""
    from pathlib import Path

    from megatron_patches.config import load_config

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## Configuration", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    (tmp_path / "guard.yaml").write_text(block)
    config = load_config(str(tmp_path / "guard.yaml"))
    assert config.detectors.magnitude.total_norm_max == 1.0e6
    assert config.recovery.lr_factor == 0.5 and config.response.on_error == "rollback"
