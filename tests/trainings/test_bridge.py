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


FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
NAN_AT_3 = f"nan:step=3,param={FC1}"
PERSISTENT_NAN_AT_5 = f"nan:step=5,count=4,param={FC1}"


class BridgeRun:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess) -> None:
        self.out = out
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "steps.jsonl").read_text().splitlines()]

    def weights(self) -> dict:
        return json.loads((self.out / "weights.json").read_text())

    def weights_by_rank(self) -> list[dict]:
        return [self.weights(), json.loads((self.out / "weights_rank1.json").read_text())]

    def incidents(self) -> list[dict]:
        path = self.out / "reports" / "incidents.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_bridge(out: Path, *args: str, inject: tuple[str, ...] = (), guard: bool = True,
               recovery: dict | None = None) -> BridgeRun:
    """One job; a second job into the same ``out`` appends to its steps.jsonl (and reports)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    if guard:
        config = out / "guard.yaml"
        config.write_text(json.dumps({"report_dir": str(out / "reports"), "inject": list(inject),
                                      **({"recovery": recovery} if recovery else {})}))
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
def test_the_import_placed_after_bridges_own_still_names_the_parameters(tmp_path):
    """Bridge's optim.py binds get_megatron_optimizer by name when imported; imported first, it kept the
    unwrapped function and the guard learned no names (drills by name refused). The lazy targets wrap
    the modules already imported at once, that binding included."""
    run = run_bridge(tmp_path / "after", "--guard-after-bridge", inject=(NAN_AT_3,))
    assert run.returncode == 0, run.output[-4000:]
    (incident,) = run.incidents()
    assert (incident["step"], incident["first"]["name"], incident["action"]) == (3, FC1, "skip_step")


@bridge_mark
def test_persistent_nan_rolled_back_by_a_restart_from_the_certified_checkpoint_with_the_lr_cut(tmp_path):
    """recovery.mode restart: the first job exits 84 with the ledger's request beside Bridge's checkpoints;
    the same command again loads iteration 2, the newest checkpoint certified (4's check was flagged at 5),
    skips the incident iterations and trains on at half the learning rate."""
    out, save = tmp_path / "persistent", tmp_path / "ckpt"
    common = ("--iters", "10", "--save", str(save), "--save-interval", "2")
    run = run_bridge(out, *common, inject=(PERSISTENT_NAN_AT_5,), recovery={"mode": "restart"})
    assert run.returncode != 0
    assert "[megatron_patches] stopping with exit code 84" in run.output
    assert f"warning: nan gradient first at {FC1}" in run.output
    assert [(i["step"], i["action"]) for i in run.incidents()] == [(5, "skip_step"), (6, "rollback")]
    markers = {int(d.name[5:]): json.loads((d / "megatron_patches.json").read_text()) for d in save.glob("iter_*")}
    assert (markers[2]["healthy"], markers[2]["certified_at"]) == (True, 3)
    assert markers[4]["not_certified"] == "step 5 was flagged before the checkpoint was certified"
    ledger = json.loads((save / "megatron_patches_ledger.json").read_text())
    assert ledger["rollback_requested"]["iteration"] == 6 and ledger["lr_scale"] == 0.5

    resumed = run_bridge(out, *common, recovery={"mode": "restart"})
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "loading healthy checkpoint iteration 2" in resumed.output
    assert "loading distributed checkpoint from" in resumed.output and "at iteration 2" in resumed.output
    steps = resumed.steps()
    restart = next(i for i in range(1, len(steps)) if steps[i]["iteration"] <= steps[i - 1]["iteration"])
    second = steps[restart:]  # the resumed job's iterations (the first job's come before)
    assert [s["iteration"] for s in second] == [3, 4, 7, 8, 9, 10]  # 5 and 6 skipped by Bridge itself
    assert {float.fromhex(s["lr"]) for s in second} == {0.0005}
    ledger = json.loads((save / "megatron_patches_ledger.json").read_text())
    assert ledger["rollback_requested"] is None and ledger["events"][-1]["resumed_from"] == 2
    assert resumed.weights()["finite"]


@pytest.fixture(scope="module")
def skipping_5_and_6(tmp_path_factory) -> BridgeRun:
    """The uninterrupted run a blacklisting rollback with ``lr_factor: 1`` must equal: Bridge's own
    ``train.iterations_to_skip`` leaves iterations 5 and 6 out."""
    run = run_bridge(tmp_path_factory.mktemp("bridge") / "skip", "--iters", "10", "--iterations-to-skip", "5", "6")
    assert run.returncode == 0, run.output[-4000:]
    return run


def _trained_after(run: BridgeRun, iteration: int) -> list[dict]:
    return [s for s in run.steps() if s["iteration"] > iteration and not s["skipped"]]


@bridge_mark
def test_a_rollback_in_process_equals_the_run_that_skips_those_iterations(skipping_5_and_6, tmp_path):
    """The default recovery.mode (in_process), snapshots every 2 iterations: the NaN of 5 and 6 is rolled
    back to the snapshot of 2 in the same processes, 3 and 4 redone on their taped batches; every later
    iteration and both ranks' final weights equal the run that skipped 5 and 6, bit for bit."""
    run = run_bridge(tmp_path / "inprocess", "--iters", "10", "--save", str(tmp_path / "ckpt"),
                     inject=(PERSISTENT_NAN_AT_5,), recovery={"lr_factor": 1, "snapshot_interval": 2})
    assert run.returncode == 0, run.output[-4000:]
    assert "rolled back in process to the snapshot of iteration 2 and redid 2 iteration(s)" in run.output
    assert "exit code 84" not in run.output
    assert _trained_after(run, 6) == _trained_after(skipping_5_and_6, 6)
    assert [s["iteration"] for s in _trained_after(run, 6)] == [7, 8, 9, 10]
    assert run.weights_by_rank() == skipping_5_and_6.weights_by_rank()
    (rolled,) = [i for i in run.incidents() if i["action"] == "rollback"]
    assert rolled["step"] == 6
    # The last save comes after the rollback, which undid the incidents: healthy.
    marker = json.loads((tmp_path / "ckpt" / "iter_0000010" / "megatron_patches.json").read_text())
    assert marker["healthy"] is True


@bridge_mark
def test_a_rollback_by_restart_equals_the_run_that_skips_those_iterations(skipping_5_and_6, tmp_path):
    """recovery.mode restart with lr_factor 1: the relaunched job, from Bridge's certified checkpoint of
    iteration 2, ends with both ranks' weights equal to the run that skipped 5 and 6."""
    out, common = tmp_path / "restart", ("--iters", "10", "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    recovery = {"mode": "restart", "lr_factor": 1}
    first = run_bridge(out, *common, inject=(PERSISTENT_NAN_AT_5,), recovery=recovery)
    assert "[megatron_patches] stopping with exit code 84" in first.output
    resumed = run_bridge(out, *common, recovery=recovery)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert _trained_after(resumed, 6) == _trained_after(skipping_5_and_6, 6)
    assert resumed.weights_by_rank() == skipping_5_and_6.weights_by_rank()


LAYOUT_DRILLS = {
    # Under the distributed optimizer rank 0 holds fc1's shard: rank 1's own gradient before the reduction.
    "dp2-bf16-distopt": (f"nan:step=4,phase=local,param={FC1},rank=1", FC1, "entered on rank(s) [1]"),
    "tp2": (f"nan:step=4,param={FC1},rank=1", FC1, "rank(s) [1]"),
    "pp2": (f"nan:step=4,param={FC1},rank=1", FC1, "rank(s) [1]"),
    "ep2": ("nan:step=4,param=decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight,rank=1",
            "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", "expert 3 (EP rank 1)"),
}


@bridge_mark
@pytest.mark.parametrize("layout", sorted(LAYOUT_DRILLS))
def test_each_layout_guarded_equals_unguarded_until_a_nan_named_with_its_rank_and_skipped(layout, tmp_path):
    """DP2 bf16 with the distributed optimizer, TP2 (+ sequence parallel), PP2, MoE EP2 in Bridge's loop:
    up to the fault every iteration equals the unguarded run's bit for bit; iteration 4's NaN on rank 1 is
    named there and skipped, and training goes on finite."""
    drill, name, where = LAYOUT_DRILLS[layout]
    unguarded = run_bridge(tmp_path / "unguarded", "--layout", layout, guard=False)
    assert unguarded.returncode == 0, unguarded.output[-4000:]
    run = run_bridge(tmp_path / "guarded", "--layout", layout, "--filter-warnings", inject=(drill,))
    assert run.returncode == 0, run.output[-4000:]
    (incident,) = run.incidents()
    assert (incident["step"], incident["kind"], incident["action"]) == (4, "nan", "skip_step")
    assert incident["first"]["name"] == name and incident["first"]["ranks"]["global"] == 1
    assert where in incident["message"]
    steps = run.steps()
    assert steps[:3] == unguarded.steps()[:3]
    assert [s["iteration"] for s in steps if s["skipped"]] == [4]
    assert run.weights()["finite"] and steps[-1]["iteration"] == 5 and not steps[-1]["skipped"]


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
