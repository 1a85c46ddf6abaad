"""Megatron-Bridge's own pretraining loop, guarded by ``import megatron_patches.apply`` (docs/bridge.md).

Each run is ``torchrun`` with two CPU ranks of :mod:`megatron_patches.testing.pretrain_bridge_cpu`: Bridge's
``pretrain`` with its config container, a tiny GPT on megatron-core's local layer spec, mock data, gloo.
Needs Megatron-Bridge (``pip install 'megatron_patches[bridge]'`` on Python 3.12, plus the steps in
docs/bridge.md); skipped where ``megatron.bridge`` is not importable, which is the case in the CI
environments. About 45 s a run on two shared cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _bridge_missing() -> str | None:
    try:
        found = importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return "megatron.bridge is not importable here (Python 3.12 + pip install 'megatron_patches[bridge]'; docs/bridge.md)"
    return None


needs_bridge = pytest.mark.skipif(_bridge_missing() is not None, reason=_bridge_missing() or "")


def bridge_mark(test):
    """A run of Bridge's loop: two ranks under torchrun, fresh processes, Bridge importable."""
    for mark in (pytest.mark.bridge, pytest.mark.multiproc, pytest.mark.process, needs_bridge):
        test = mark(test)
    return test


NAN_AT_3 = "nan:step=3,param=decoder.layers.1.mlp.linear_fc1.weight"
PERSISTENT_NAN_AT_5 = "nan:step=5,count=4,param=decoder.layers.1.mlp.linear_fc1.weight"


class BridgeRun:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess) -> None:
        self.out = out
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "steps.jsonl").read_text().splitlines()]

    def weights(self) -> dict:
        return json.loads((self.out / "weights.json").read_text())

    def incidents(self) -> list[dict]:
        path = self.out / "reports" / "incidents.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_bridge(out: Path, *args: str, inject: tuple[str, ...] = (), guard: bool = True) -> BridgeRun:
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    if guard:
        config = out / "guard.yaml"
        config.write_text(json.dumps({"report_dir": str(out / "reports"), "inject": list(inject)}))
        env["MEGATRON_PATCHES_CONFIG"] = str(config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_patches.testing.pretrain_bridge_cpu", "--out", str(out), *args]
    if not guard:
        cmd.append("--no-guard")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return BridgeRun(out, proc)


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory) -> BridgeRun:
    run = run_bridge(tmp_path_factory.mktemp("bridge") / "unguarded", guard=False)
    assert run.returncode == 0, run.output[-4000:]
    return run


@bridge_mark
def test_clean_run_guarded_equals_unguarded_bit_for_bit(unguarded, tmp_path):
    guarded = run_bridge(tmp_path / "guarded")
    assert guarded.returncode == 0, guarded.output[-4000:]
    assert "[megatron_patches] guarding megatron-core" in guarded.output
    assert guarded.steps() == unguarded.steps()
    assert guarded.weights() == unguarded.weights()
    assert guarded.weights()["finite"]
    # The guard saw the model's parameters by name (it does not when imported after Bridge).
    history = [json.loads(line) for line in (guarded.out / "reports" / "grad_history.jsonl").read_text().splitlines()]
    assert {"0", "1", "embedding", "output"} <= set(history[-1]["layers"])


@bridge_mark
def test_nan_named_with_its_ranks_and_skipped_in_bridges_loop(unguarded, tmp_path):
    run = run_bridge(tmp_path / "nan", "--filter-warnings", inject=(NAN_AT_3,))
    assert run.returncode == 0, run.output[-4000:]
    (incident,) = run.incidents()
    assert incident["step"] == 3 and incident["kind"] == "nan" and incident["action"] == "skip_step"
    assert incident["first"]["name"] == "decoder.layers.1.mlp.linear_fc1.weight"
    assert incident["first"]["layer"] == 1
    assert incident["ranks_affected"] == [0, 1]
    steps = run.steps()
    assert [s["iteration"] for s in steps if s["skipped"]] == [3]  # Bridge itself counted it skipped
    assert steps[:2] == unguarded.steps()[:2]  # identical up to the fault
    assert run.weights()["finite"]
    # Bridge's default LoggerConfig(filter_warnings=True) filters the guard's warning line out of the log.
    assert "warning: nan gradient" not in run.output


@bridge_mark
def test_persistent_nan_stops_bridges_loop_for_a_rollback_restart(tmp_path):
    run = run_bridge(tmp_path / "persistent", "--iters", "10", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "2", inject=(PERSISTENT_NAN_AT_5,))
    assert run.returncode != 0
    assert "[megatron_patches] stopping with exit code 84" in run.output
    assert "warning: nan gradient first at decoder.layers.1.mlp.linear_fc1.weight" in run.output
    actions = [(i["step"], i["action"]) for i in run.incidents()]
    assert actions == [(5, "skip_step"), (6, "rollback")]
    # Bridge's own checkpoints from before the fault are there to restart from.
    assert (tmp_path / "ckpt" / "iter_0000004").is_dir()


@pytest.mark.one_line
def test_stand_ins_reach_only_the_module_they_are_served_to(tmp_path, monkeypatch):
    """No Bridge needed: a module named in STAND_INS imports Transformer Engine unguarded and subclasses
    its TransformerLayer, as Bridge's gpt_full_te_layer_autocast_spec.py does; it imports, building
    the class raises with the stand-in's name, and a guarded import anywhere else still finds no TE."""
    from megatron_patches.testing import bridge_cpu

    (tmp_path / "standin_te_user.py").write_text(
        "import transformer_engine.pytorch as te\n"
        "from transformer_engine.pytorch import TransformerLayer\n"
        "class Layer(TransformerLayer):\n    pass\n"
        "FUSED = te.ops.Sequential\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        import standin_te_user  # noqa: F401  (the control: without the stand-in it cannot import)
    monkeypatch.setitem(bridge_cpu.STAND_INS, "standin_te_user", (bridge_cpu.TE_STAND_IN,))
    bridge_cpu.install_stand_ins()
    try:
        import standin_te_user

        with pytest.raises(bridge_cpu.CpuStandInError, match="transformer_engine.pytorch.TransformerLayer"):
            standin_te_user.Layer()
        assert "transformer_engine" not in sys.modules
        with pytest.raises(ImportError):
            import transformer_engine  # noqa: F401  (what every guarded import elsewhere sees)
    finally:
        bridge_cpu.uninstall()
        sys.modules.pop("standin_te_user", None)
    assert not any(type(f).__module__ == bridge_cpu.__name__ for f in sys.meta_path)
