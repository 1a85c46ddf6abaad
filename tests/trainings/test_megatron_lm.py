"""Megatron-LM's pretrain_gpt.py under the guard, and the restart launcher.

Tests marked ``megatron_lm`` train the real ``pretrain_gpt.py`` of the checkout in
``MEGATRON_LM_DIR`` on two CPU ranks (``megatron_patches.testing.pretrain_cpu``); they patch a
copy of it and skip, saying why, without one. The launcher tests run real child processes that
exit like a training job would; they and the helper tests run in CI.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from conftest import REPO, run_packaged_loop
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS

from megatron_patches import checkpoint
from megatron_patches.ledger import LEDGER_FILE, Ledger
from megatron_patches.findings import RankReport
from megatron_patches.report import diagnosis
from megatron_patches.seams import megatron_lm, rerun_machine

LAUNCHER = REPO / "scripts" / "restart_on_rollback.py"
PATCH_CLI = REPO / "scripts" / "megatron_patch.py"
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def launch(tmp_path: Path, child: str, *options: str, extra: tuple = ()) -> subprocess.CompletedProcess:
    """The launcher around ``python -c child`` (which sees the attempt number in $ATTEMPT_FILE)."""
    env = {**os.environ, "ATTEMPT_FILE": str(tmp_path / "attempts")}
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *options, "--", sys.executable, "-c", child, *extra],
        capture_output=True, text=True, timeout=120, env=env)


COUNT_ATTEMPTS = """
import json, os, sys
path = os.environ["ATTEMPT_FILE"]
attempt = int(open(path).read()) + 1 if os.path.exists(path) else 1
open(path, "w").write(str(attempt))
"""


def attempts(tmp_path: Path) -> int:
    return int((tmp_path / "attempts").read_text())


# --- the launcher (CI) -----------------------------------------------------------------------------


def test_launcher_restarts_on_84_and_ends_with_the_successful_run(tmp_path):
    run = launch(tmp_path, COUNT_ATTEMPTS + "sys.exit(84 if attempt == 1 else 0)", "--max-restarts", "3")
    assert run.returncode == 0, run.stderr
    assert attempts(tmp_path) == 2
    assert "attempt 1: rollback (exit 84" in run.stderr and "restarting (1 of 3)" in run.stderr


def test_launcher_reads_the_ledger_when_torchrun_reports_1(tmp_path):
    # torchrun exits 1 when its workers exit 84; the ledger next to --save tells it was a rollback.
    save = tmp_path / "ckpt"
    child = COUNT_ATTEMPTS + textwrap.dedent(f"""
    if attempt == 1:
        os.makedirs({str(save)!r}, exist_ok=True)
        json.dump({{"schema": "megatron_patches.ledger/1", "rollbacks": 1, "lr_scale": 0.5,
                   "rollback_requested": {{"iteration": 4, "skip_iterations": [3, 4]}}}},
                  open(os.path.join({str(save)!r}, {LEDGER_FILE!r}), "w"))
        sys.exit(1)
    sys.exit(0)
    """)
    run = launch(tmp_path, child, extra=("--save", str(save)))
    assert run.returncode == 0, run.stderr
    assert attempts(tmp_path) == 2
    assert "ledger: rollback 1 requested at iteration 4, lr scale 0.5, skipping iterations [3, 4]" in run.stderr


@pytest.mark.parametrize("code", [1, 85, 86])
def test_launcher_passes_other_failures_through(tmp_path, code):
    # An old ledger (rollback count unchanged by this attempt) is not a new rollback request.
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LEDGER_FILE).write_text(json.dumps({"rollbacks": 1, "rollback_requested": {"iteration": 4}}))
    run = launch(tmp_path, COUNT_ATTEMPTS + f"sys.exit({code})", "--checkpoint-dir", str(save))
    assert run.returncode == code
    assert attempts(tmp_path) == 1
    assert f"exited with {code}" in run.stderr and "not a rollback" in run.stderr


def test_launcher_stops_when_the_restart_budget_is_spent(tmp_path):
    run = launch(tmp_path, COUNT_ATTEMPTS + "sys.exit(84)", "--max-restarts", "1")
    assert run.returncode == 84
    assert attempts(tmp_path) == 2
    assert "restart budget of 1 is spent" in run.stderr


def test_launcher_refuses_a_missing_command_and_answers_help():
    run = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "1"], capture_output=True, text=True)
    assert run.returncode == 2 and "put the training command after --" in run.stderr
    run = subprocess.run([sys.executable, str(LAUNCHER), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--restart-on CODES" in run.stdout


# --- helpers that need no checkout (CI) -------------------------------------------------------------


def _iteration_dir(root: Path, iteration: int, healthy: bool | None) -> None:
    directory = Path(checkpoint.checkpoint_dir(str(root), iteration))
    directory.mkdir(parents=True)
    if healthy is not None:
        megatron_lm.write_marker(str(directory), iteration, healthy, incidents=0)


def test_rollback_target_is_the_newest_healthy_complete_checkpoint(tmp_path):
    _iteration_dir(tmp_path, 2, healthy=True)
    _iteration_dir(tmp_path, 4, healthy=True)
    _iteration_dir(tmp_path, 6, healthy=False)   # an incident since the save at 4
    _iteration_dir(tmp_path, 8, healthy=True)    # async save not finished: past the tracker
    _iteration_dir(tmp_path, 10, healthy=None)   # saved without the guard: unknown, never picked
    (tmp_path / megatron_lm.TRACKER_FILE).write_text("6")
    assert megatron_lm.newest_healthy_iteration(str(tmp_path)) == 4
    (tmp_path / megatron_lm.TRACKER_FILE).write_text("release")
    assert megatron_lm.newest_healthy_iteration(str(tmp_path)) == 8


def test_a_checkpoint_remembers_the_lr_scale_it_was_saved_with(tmp_path):
    # From 0.19 on the optimizer finds saved param groups by max_lr: a restart must know it.
    directory = Path(checkpoint.checkpoint_dir(str(tmp_path), 4))
    directory.mkdir(parents=True)
    assert megatron_lm.saved_lr_scale(str(tmp_path), 4) == 1.0  # no marker: saved unscaled
    megatron_lm.write_marker(str(directory), 4, True, incidents=0, lr_scale=0.25)
    assert megatron_lm.saved_lr_scale(str(tmp_path), 4) == 0.25
    (directory / checkpoint.MARKER).write_text('{"step": 4, "healthy": true, "lr_scale": "nan"}')
    assert megatron_lm.saved_lr_scale(str(tmp_path), 4) == 1.0


def test_iterations_to_skip_follow_each_release_numbering():
    # Up to core 0.16 Megatron-LM tests the 0-based index, from 0.17 on the logged number.
    assert megatron_lm.to_iterations_to_skip([3, 4], (0, 16)) == [2, 3]
    assert megatron_lm.to_iterations_to_skip([3, 4], (0, 17)) == [3, 4]


def test_skip_iterations_survive_later_restarts_in_the_ledger(tmp_path):
    ledger = Ledger(events=[{"step": 4, "exit": 84, "skip_iterations": [3, 4]}, {"resumed_from": 2},
                            {"step": 9, "exit": 84, "skip_iterations": [9]}])
    ledger.save(str(tmp_path))
    assert megatron_lm.skip_iterations(Ledger.load(str(tmp_path))) == [3, 4, 9]


def test_training_targets_are_skipped_where_megatron_training_is_absent(clean_patches, caplog):
    pytest.importorskip("megatron.core")
    try:
        import megatron.training  # noqa: F401

        pytest.skip("megatron.training is importable here: the optional targets would be installed")
    except ImportError:
        pass
    from megatron_patches.seams import patching
    from megatron_patches.seams.targets import TRAINING_TARGETS

    logger = logging.getLogger("megatron_patches")  # runtime.install() may have stopped propagation
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="megatron_patches"):
            done = patching.install()
    finally:
        logger.removeHandler(caplog.handler)
    assert done and not any(t.dotted in done for t in TRAINING_TARGETS)
    for target in TRAINING_TARGETS:  # said at debug level; the one info line names the module
        assert any(f"{target.dotted} skipped: {target.module} is not importable" in r.message
                   for r in caplog.records if r.levelno == logging.DEBUG)
    summary = [r.message for r in caplog.records if r.levelno >= logging.INFO]
    assert summary and "megatron.training absent (its targets skipped)" in summary[-1], summary


# --- Megatron-LM's loop: the packaged one (megatron-core 0.17+, CI) or a checkout (MEGATRON_LM_DIR) ------

TINY = [*TINY_GPT_ARGS, "--train-iters", "6"]
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")


@pytest.fixture(scope="module")
def megatron_lm_checkout(megatron_lm_dir) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git not on PATH: scripts/megatron_patch.py applies the patches with git apply")
    return megatron_lm_dir


def patched_copy(checkout: Path, where: Path, only: str | None) -> Path:
    """A copy of the checkout (never the checkout itself) with our source patches applied:
    all of them, or ``--only pretrain`` (the import line; hooks then come from the runtime wrappers)."""
    copy = where / "Megatron-LM"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "tests", "docs", "examples", "images"))
    subprocess.run([sys.executable, str(PATCH_CLI), "revert", "--megatron", str(copy)], capture_output=True)
    proc = subprocess.run([sys.executable, str(PATCH_CLI), "apply", "--megatron", str(copy),
                           *(["--only", only] if only else [])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return copy


@dataclass
class Loop:
    """Where Megatron-LM's training loop comes from: a patched copy of a checkout, or (``tree`` None)
    the ``megatron/training`` that the installed megatron-core package ships."""

    tree: Path | None
    nproc: int = 2

    @property
    def version(self) -> tuple[int, int]:
        if self.tree is None:
            from megatron.core import package_info

            return tuple(int(x) for x in package_info.__version__.split(".")[:2])
        info = (self.tree / "megatron" / "core" / "package_info.py").read_text()
        return tuple(int(re.search(rf"^{key} = (\d+)", info, re.M).group(1)) for key in ("MAJOR", "MINOR"))

    def command(self, *extra: str) -> list[str]:
        script = [] if self.tree is None else [str(self.tree / "pretrain_gpt.py")]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                "-m", "megatron_patches.testing.pretrain_cpu", *script, *TINY, *extra]

    def run(self, env: dict, *extra: str, process: bool = False) -> subprocess.CompletedProcess:
        """Train with ``extra`` flags under ``env`` from the repository root (10 minutes at most).
        The packaged loop's ranks are forked from this process (:func:`conftest.run_packaged_loop`:
        the code returned is the failing rank's own, output all in ``stdout``); a checkout, or
        ``process=True`` where torchrun's own behaviour is under test, runs under torchrun."""
        if self.tree is not None or process:
            return subprocess.run(self.command(*extra), capture_output=True, text=True, timeout=600, cwd=REPO,
                                  env=env)
        code, output = run_packaged_loop(env, [*TINY, *extra], nproc=self.nproc)
        return subprocess.CompletedProcess(self.command(*extra), code, output, "")

    def checkpoint_format(self) -> list[str]:
        """torch_dist saves of core <= 0.15 call np.product, gone in NumPy 2: the legacy format then."""
        import numpy

        if self.version < (0, 16) and int(numpy.__version__.split(".")[0]) >= 2:
            return ["--ckpt-format", "torch"]
        return []


def _packaged_loop_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


@pytest.fixture(params=["package", pytest.param("checkout", marks=pytest.mark.megatron_lm)])
def loop_kind(request) -> str:
    if request.param == "package" and not _packaged_loop_available():
        pytest.skip("the installed megatron-core ships no megatron/training (0.17+ does: "
                    "make test PYTHON=python3.12 VENV=.venv312)")
    if request.param == "checkout":
        request.getfixturevalue("megatron_lm_checkout")
    return request.param


def make_loop(kind: str, request, where: Path, only: str | None) -> Loop:
    """The packaged loop as is (runtime wrappers, ``import megatron_patches.apply`` in the runner),
    or a checkout copy with the source patches named by ``only``."""
    if kind == "package":
        return Loop(None)
    return Loop(patched_copy(request.getfixturevalue("megatron_lm_checkout"), where, only))


def guard_env(tmp_path: Path, **config) -> dict:
    path = tmp_path / "guard.yaml"
    path.write_text(json.dumps({"report_dir": str(tmp_path / "reports"), **config}))  # JSON is YAML
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(path)}
    return env


def iterations(output: str) -> dict[int, str]:
    """Megatron's per-iteration log lines by iteration number (the last one of each number wins)."""
    return {int(m.group(1)): m.group(2) for m in ITERATION_LINE.finditer(output)}


def incidents(tmp_path: Path) -> list[dict]:
    path = tmp_path / "reports" / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report_text(tmp_path: Path) -> str:
    """What ``megatron-patches report`` prints for the run's reports directory."""
    return subprocess.run([sys.executable, "-m", "megatron_patches", "report", str(tmp_path / "reports")],
                          capture_output=True, text=True, cwd=REPO).stdout


def rollback_run(loop: Loop, tmp_path: Path, drill: str, *extra: str, config: dict | None = None) -> tuple[str, str]:
    """The launcher around ``loop`` with checkpoints every 2 iterations and ``drill`` as the guard's
    drill; asserts it ends with exit 0 and returns the first and the second attempt's output (one
    stream, so that the launcher's lines fall between the two attempts)."""
    save = tmp_path / "ckpt"
    command = loop.command("--save", str(save), "--load", str(save), "--save-interval", "2", *extra,
                           *loop.checkpoint_format())
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "2", "--", *command],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=REPO,
                          env=guard_env(tmp_path, inject=[drill], **(config or {})))
    assert proc.returncode == 0, proc.stdout[-6000:]
    first, second = proc.stdout.split("[restart_on_rollback] attempt 2:")
    return first, second


@pytest.mark.multiproc
def test_pretrain_gpt_names_the_parameter_at_megatrons_iteration(loop_kind, request, tmp_path):
    """One run, three readers: the incident record and the fault scene, Megatron's iteration log,
    and the guard's series in Megatron's TensorBoard and W&B writers (W&B offline: nothing leaves
    the machine; left out where wandb is not installed)."""
    loop = make_loop(loop_kind, request, tmp_path, only=None)  # a checkout: the full source patch
    tensorboard = tmp_path / "tb"
    env = guard_env(tmp_path, inject=[f"nan:step=3,param={FC1}"])
    wandb = importlib.util.find_spec("wandb") is not None
    if wandb:
        env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    proc = loop.run(env, "--tensorboard-dir", str(tensorboard), *(
        ["--wandb-project", "guard-ci", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wandb")]
        if wandb else []))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]

    [incident] = incidents(tmp_path)
    assert incident["step"] == 3 and incident["kind"] == "nan" and incident["action"] == "skip_step"
    assert incident["first"]["name"] == FC1 and incident["first"]["layer"] == 1
    # Iteration 3 as Megatron logs it; global batch 4, so samples 8..11 of the training set.
    assert incident["batch"] == {"iteration": 3, "consumed_train_samples": 8, "samples": [8, 9, 10, 11]}
    # Each rank's fault scene holds its own half of the batch: data-parallel rank 1 read 10 and 11.
    import torch

    from megatron_patches.scene import scene_dir

    scene = torch.load(Path(scene_dir(str(tmp_path / "reports"), 3, 1)) / "scene.pt", weights_only=False)
    assert {k: scene["batch"][k] for k in ("iteration", "consumed_train_samples", "samples")} == {
        "iteration": 3, "consumed_train_samples": 8, "samples": [10, 11]}
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "number of skipped iterations:   1" in logged[3]
    # A skipped iteration logs no loss; from 0.17 on the loop logs it as 0.
    assert ("lm loss: 0.000000E+00" in logged[3]) if loop.version >= (0, 17) else ("lm loss" not in logged[3])
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (4, 5, 6)]
    assert all(loss == loss and loss < 100 for loss in losses), losses

    writers = {}
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tensorboard))
        events.Reload()
        writers["tensorboard"] = {tag: {e.step: e.value for e in events.Scalars(tag)}
                                  for tag in events.Tags()["scalars"]}
    if wandb:
        [run_file] = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
        series: dict[str, dict[int, float]] = {}
        for row in wandb_history(run_file):
            for key, value in row.items():
                if key.startswith("megatron_patches/"):
                    series.setdefault(key, {})[row["_step"]] = value
        writers["wandb"] = series
    for name, scalars in writers.items():
        assert scalars["megatron_patches/incidents"] == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}, name
        assert scalars["megatron_patches/skipped_steps"][3] == 1, name
        assert sorted(scalars["megatron_patches/total_grad_norm"]) == [1, 2, 4, 5, 6], name  # none for the NaN step
    if len(writers) < 2:  # the test extras install both; say so where one is missing
        pytest.skip(f"checked the record and the log, and only {sorted(writers)} of tensorboard, wandb (not installed)")


@pytest.mark.multiproc
def test_persistent_fault_exits_84_and_the_launcher_resumes_from_the_healthy_checkpoint_in_safe_mode(
        loop_kind, request, tmp_path):
    """The rollback path end to end, and safe mode on the restart (recovery.disable_features
    [dropout, overlap_grad_reduce], issue 27): Megatron's default dropout 0.1 and
    --overlap-grad-reduce in the first attempt; after the rollback the restarted job's args are
    switched off before its model is built, and the built model shows it: no dropout module or
    layer with p > 0, DDP without overlap. The report says both beside the incident. With
    --non-persistent-save-interval 1 a non-persistent iteration 3 is left, newer than the target,
    which Megatron would load in preference to --ckpt-step: the restart loads iteration 2, the
    newest certified checkpoint (the clean check of 3 certified it; 4 holds an incident)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")  # hooks from the runtime wrappers
    save = tmp_path / "ckpt"
    first, second = rollback_run(loop, tmp_path, f"nan:step=4,count=2,param={FC1}", "--overlap-grad-reduce",
                                 "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global",
                                 config={"recovery": {"disable_features": ["dropout", "overlap_grad_reduce"]}})
    # Iteration 4 skipped (warning), iteration 5 again: an error, so every rank stops with 84. The
    # default in-process rollback cannot switch the overlap off in the live model: it says so first.
    assert ("rollback at iteration 5 made by a restart, not in process: recovery switches off "
            "overlap_grad_reduce, which needs the model built again") in first
    assert first.count("stopping with exit code 84") == 2
    assert re.search(r"exitcode\s*: 84", first)  # torchrun itself exits 1 and names the 84
    assert "ledger: rollback 1 requested at iteration 5" in first
    assert [i["step"] for i in incidents(tmp_path)] == [4, 5]
    assert incidents(tmp_path)[1]["severity"] == "error" and incidents(tmp_path)[1]["action"] == "rollback"

    # The restart loads iteration 2 (the newest certified one), trains 3, skips 4 and 5, trains 6, at half the lr.
    assert (save / "non_persistent" / "iter_0000003").is_dir() or "non_persistent/iter_0000003" in first
    assert "non-persistent (global) checkpoints are not loaded on this restart" in second
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert "resumed from healthy checkpoint iteration 2" in second
    resumed = iterations(second)
    assert sorted(resumed) == [3, 6]
    assert all("learning rate: 5.000000E-04" in line and "lm loss" in line for line in resumed.values())
    assert "learning rate: 1.000000E-03" in iterations(first)[2]

    ledger = Ledger.load(str(save))
    assert ledger.rollbacks == 1 and ledger.lr_scale == 0.5 and ledger.rollback_requested is None
    assert ledger.events[0]["skip_iterations"] == [4, 5] and ledger.events[1]["resumed_from"] == 2
    marks = {step: ok for step, _, ok in checkpoint.list_checkpoints(str(save))}
    assert marks[2] and not marks[4]  # 4 was saved after the incident of 4

    # The report finds the outcome through the ledger the rollback's record names.
    assert incidents(tmp_path)[1]["ledger"] == str(save / LEDGER_FILE)
    report = subprocess.run([sys.executable, "-m", "megatron_patches", "report", str(tmp_path / "reports"), "--json"],
                            capture_output=True, text=True)
    rollback = json.loads(report.stdout)["incidents"][1]
    assert {k: rollback[k] for k in ("rolled_back_to", "lr_scale", "iterations_skipped", "restart", "restarts_used")} \
        == {"rolled_back_to": 2, "lr_scale": 0.5, "iterations_skipped": [4, 5], "restart": 1, "restarts_used": 1}
    text = report_text(tmp_path)
    assert ("rolled back to the healthy checkpoint of step 2, learning rate x0.5; resumed in safe mode without "
            "dropout, overlap_grad_reduce; iteration(s) 4, 5 skipped on resuming; restart 1 (1 rollback(s) used in "
            "this job)") in text, text

    # Safe mode: nothing in the first attempt, the features off in the second one's args and model.
    assert "safe mode" not in first
    assert ("safe mode after rollback 1: switched off dropout, overlap_grad_reduce (hidden_dropout 0.1 -> 0.0; "
            "attention_dropout 0.1 -> 0.0; overlap_grad_reduce True -> False)") in second, second[-4000:]
    built = re.search(r"safe mode in the built model: (\d+) of (\d+) dropout modules with p > 0, (\d+) of (\d+) "
                      r"layers with hidden_dropout > 0; overlap_grad_reduce=(\w+)", second)
    assert built and built.group(1) == "0" and int(built.group(2)) > 0 and built.group(3) == "0", second[-4000:]
    assert built.group(5) == "False"
    assert ledger.disabled_features == ["dropout", "overlap_grad_reduce"]


@pytest.mark.multiproc
def test_detector_baselines_survive_a_megatron_lm_restart(loop_kind, request, tmp_path):
    """Each rank's history baselines are saved in iter_N and restored on --load: a finite x100
    spike on the first iteration after the resume is judged against the pre-restart history
    (without them it would fall in a fresh warm-up and pass unseen)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    history = {"detectors": {"history": {"warmup_steps": 8}}}
    # A 14-iteration job stopped by Megatron's --exit-interval at 12 (it saves there), then resumed.
    first = loop.run(guard_env(tmp_path, **history), "--save", str(save), "--save-interval", "12",
                     *loop.checkpoint_format(), "--train-iters", "14", "--exit-interval", "12")
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert sorted(p.name for p in (save / "iter_0000012" / megatron_lm.STATE_DIR).iterdir()) == [
        "rank_00000.json", "rank_00001.json"]
    assert incidents(tmp_path) == []

    env = guard_env(tmp_path, **history, inject=[f"spike:step=13,param={FC1},factor=100"])
    resumed = loop.run(env, "--save", str(save), "--load", str(save), "--save-interval", "100",
                       *loop.checkpoint_format(), "--train-iters", "14")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "guard state of iteration 12 restored" in output
    [incident] = incidents(tmp_path)
    assert incident["step"] == 13 and incident["kind"] == "zscore", incident
    assert incident["first"]["name"] == FC1


def wandb_history(run_file: Path) -> list[dict]:
    """The ``history`` rows of an offline W&B run file, read directly: the file is a LevelDB-style
    log (a 7-byte W&B header, then 32 KiB blocks of records, each with a 7-byte header: checksum,
    length, type FULL/FIRST/MIDDLE/LAST) of serialized ``wandb_internal_pb2.Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, header = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", run_file
    records, pending, offset = [], b"", header
    while offset + header <= len(data):
        if block - offset % block < header:  # too little room left in this block: padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + header])
        payload = data[offset + header:offset + header + length]
        offset += header + length
        if kind == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows



def one_off_local_nan(loop: Loop, tmp_path: Path, *extra: str, megatrons_check: bool = True) -> tuple[str, dict]:
    """Stock flags (Megatron's pre-reduction NaN check on, --rerun-mode validate_results), 2 ranks,
    one NaN in rank 1's own fc1 gradient at iteration 4: the run must end 0 with one incident.
    ``megatrons_check`` False: ``extra`` turns Megatron's check off; the guard's own fused pass
    before the reduction finds the origin (nothing logged then until the incident)."""
    env = guard_env(tmp_path, inject=[f"nan:step=4,rank=1,phase=local,param={FC1}"])
    proc = loop.run(env, *extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    if megatrons_check:
        # Megatron's rerun machine reran the step in place and called it transient; not fatal, so no
        # exit 17: its verdict is the record's.
        assert "Need to rerun step" in output and "Possible transient error" in output
        assert "Continuing normal execution because failed validation was not fatal" in output
        assert re.search(rf"before the data-parallel reduction: non-finite local gradient on rank 1 .*{FC1}", output)
    else:  # nothing of Megatron's looked at the gradients: no rerun
        assert "Need to rerun step" not in output and "Possible transient error" not in output
    [incident] = incidents(tmp_path)
    assert incident["step"] == 4 and incident["kind"] == "nan" and incident["action"] == "skip_step"
    assert incident["first"]["name"] == FC1 and incident["origin_ranks"] == [1]
    assert incident["severity"] == "warning"  # one origin: below critical
    if megatrons_check:
        assert incident["megatron_rerun"]["verdict"] == "transient"
        [rerun] = incident["megatron_rerun"]["by_rank"]
        assert rerun["rank"] == 1 and rerun["check"] == "bucket norm" and rerun["mode"] == "validate_results"
    else:
        assert "megatron_rerun" not in incident
    assert "loss_nonfinite" not in incident and "all_gradients_nonfinite" not in incident
    # Named where Megatron's bucket check found it: on rank 1, before the reduction spread it.
    [before] = incident["pre_reduction"]
    assert before["name"] == FC1 and before["nan"] == 1 and before["layer"] == 1
    assert before["ranks"]["global"] == 1 and before["ranks"]["dp"] == 1
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "number of skipped iterations:   1" in logged[4]
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (5, 6)]
    assert all(loss == loss and loss < 100 for loss in losses), losses
    return output, incident


@pytest.mark.multiproc
def test_stock_flags_local_nan_on_one_rank_is_the_guards_incident_not_megatrons_exit(loop_kind, request, tmp_path):
    """The bucket check finds rank 1's NaN before the reduction; the guard names it, skips the
    step and the job runs to its last iteration instead of Megatron's rerun machine ending it with 17."""
    one_off_local_nan(make_loop(loop_kind, request, tmp_path, only="pretrain"), tmp_path)


@pytest.mark.multiproc
def test_overlapped_reduction_local_nan_is_named_at_its_bucket_with_one_origin(loop_kind, request, tmp_path):
    """--overlap-grad-reduce: buckets are reduced during backward, before finalize_model_grads. The
    drill and the origin flag go in at the bucket's check, before its collective: one origin,
    graded below critical; after the reduce-scatter the NaN sits in its owner's shard."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    _, incident = one_off_local_nan(loop, tmp_path, "--overlap-grad-reduce", "--use-distributed-optimizer")
    assert all(p["shard"] for p in incident["params"])


@pytest.mark.multiproc
def test_a_finite_local_gradient_whose_norm_overflows_is_an_origin(loop_kind, request, tmp_path, monkeypatch):
    """Rank 1's fc1 gradient with the high exponent bit set in every element: finite values of 2^64
    and more, whose squares overflow Megatron's float32 bucket norm (Inf). Megatron reruns the step
    in place and gets clean gradients; without the guard naming the overflow there, the check
    before clipping saw nothing and the fault left no record (the negative control)."""
    drill = f"bitflip:step=4,rank=1,phase=local,param={FC1},bit=exponent_high,scope=all"
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    (tmp_path / "named").mkdir()
    (tmp_path / "unnamed").mkdir()
    output = loop.run(guard_env(tmp_path / "named", inject=[drill])).stdout
    assert "overflowing (finite, squares past float32) local gradient on rank 1" in output, output[-4000:]
    [incident] = incidents(tmp_path / "named")
    assert (incident["step"], incident["kind"], incident["action"]) == (4, "overflow", "skip_step")
    assert incident["origin_ranks"] == [1] and incident["first"]["name"] == FC1
    [before] = incident["pre_reduction"]
    assert before["ranks"]["global"] == 1 and before["overflow"] > 0 and before["reasons"] == ["overflow"]
    from megatron_patches.seams import bucket_norms

    monkeypatch.setattr(bucket_norms, "overflowed_params", lambda chunks, group: [])
    proc = loop.run(guard_env(tmp_path / "unnamed", inject=[drill]))
    assert proc.returncode == 0 and "Possible transient error" in proc.stdout
    assert incidents(tmp_path / "unnamed") == []


@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop_available(), reason="the installed megatron-core ships no megatron/training")
def test_a_finite_fault_in_one_replicas_gradient_is_named_there_from_megatrons_bucket_norms(tmp_path, monkeypatch):
    """Stock flags, DP2: Megatron's bucket check stands in for the guard's own pass before the
    reduction (no extra read), so no per-parameter norm of rank 1's own gradient is taken. Rank 1's
    fc1 gradient x1,000 at iteration 24 (after history's 20-step warm-up): its bucket norm against
    its running mean names rank 1 as the origin; without it (the negative control) the reduced
    gradient is flagged with no origin, named first on the rank that holds it."""
    loop = Loop(None)
    drill = f"scale:step=24,rank=1,phase=local,param={FC1},factor=1000,scope=all"
    for name in ("named", "unnamed"):
        (tmp_path / name).mkdir()
        proc = loop.run(guard_env(tmp_path / name, inject=[drill]), "--train-iters", "25")
        assert proc.returncode == 0, proc.stdout[-4000:]
        [incident] = incidents(tmp_path / name)
        assert incident["step"] == 24 and incident["first"]["name"] == FC1
        if name == "named":
            assert incident["origin_ranks"] == [1], incident["message"]
            from megatron_patches.seams import origin

            monkeypatch.setattr(origin.OriginWatch, "note_bucket_norms", lambda self, group, norms, step: None)
        else:
            assert incident["origin_ranks"] == [], incident["message"]


GPU_OVERLAP_FLAGS = ("--overlap-grad-reduce", "--use-distributed-optimizer", "--bf16",
                     "--no-check-for-nan-in-loss-and-grad")
"""What GPU users run: reductions overlapped with backward, Megatron's own NaN check off."""


@pytest.mark.multiproc
def test_overlapped_reduction_without_megatrons_check_names_one_origin(loop_kind, request, tmp_path):
    """Megatron's check off, reductions overlapped: each bucket group's reduction starts during
    backward, long before finalize_model_grads. The drill and the origin flag (one fused pass over
    the group's own gradients) go in at the group's start_grad_sync, before its collective: one
    origin, graded warning, the parameter named on dp 1."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    _, incident = one_off_local_nan(loop, tmp_path, *GPU_OVERLAP_FLAGS, megatrons_check=False)
    reached_the_optimizer(incident)


def reached_the_optimizer(incident: dict) -> None:
    """The drill went in before the collective: the reduce-scatter carried the NaN into its owner's
    shard, where the optimizer found it. (A drill after the collective started leaves it in a
    buffer the reduction no longer reads: an incident from the origin read alone, no params.)"""
    assert [p["name"] for p in incident["params"]] == [FC1] and all(p["shard"] for p in incident["params"])


@pytest.mark.multiproc
def test_overlapped_param_gather_without_megatrons_check_names_one_origin(loop_kind, request, tmp_path):
    """The same with --overlap-param-gather (the next step's parameters are gathered during its
    forward): the reduction side goes through the same start_grad_sync."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    _, incident = one_off_local_nan(loop, tmp_path, *GPU_OVERLAP_FLAGS, "--overlap-param-gather",
                                    megatrons_check=False)
    reached_the_optimizer(incident)


@pytest.mark.multiproc
def test_interleaved_overlapped_reduction_without_megatrons_check_names_one_origin(loop_kind, request, tmp_path):
    """Interleaved pipeline (PP 2 x VPP 2) over two data-parallel replicas, 4 ranks: the schedule
    starts each model chunk's reduction through grad_sync_func in the middle of the pipeline's
    backward. Rank 1 (pp 0, dp 1) holds global layer 2 in its second chunk; its NaN goes in before
    that chunk's collective: one origin, warning, the reduce-scatter carries it into the owner's
    shard."""
    name = "decoder.layers.2.mlp.linear_fc1.weight"
    loop = replace(make_loop(loop_kind, request, tmp_path, only="pretrain"), nproc=4)
    env = guard_env(tmp_path, inject=[f"nan:step=3,rank=1,phase=local,param={name}"])
    proc = loop.run(env, *GPU_OVERLAP_FLAGS, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["severity"]) == (3, "skip_step", "warning")
    assert incident["origin_ranks"] == [1]
    [before] = incident["pre_reduction"]
    assert (before["name"], before["layer"], before["ranks"]["global"], before["ranks"]["pp"]) == (name, 2, 1, 0)
    assert [p["name"] for p in incident["params"]] == [name] and all(p["shard"] for p in incident["params"])
    assert sorted(iterations(output)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.multiproc
def test_stock_flags_persistent_local_nan_takes_the_guards_rollback_path(loop_kind, request, tmp_path):
    """Stock flags, rank 1's own gradient NaN at iterations 4 and 5: the guard, not Megatron's rerun
    machine, handles both (skip, then rollback with exit 84), and the launcher resumes from the
    certified checkpoint to the last iteration."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    first, second = rollback_run(loop, tmp_path, f"nan:step=4,count=2,rank=1,phase=local,param={FC1}")
    output = first + second
    # Megatron reruns each step in place (transient: the drill fires once a step) and carries on.
    assert "exitcode  : 17" not in output and "exitcode  : 16" not in output

    assert first.count("stopping with exit code 84") == 2
    found = incidents(tmp_path)
    assert [i["step"] for i in found] == [4, 5]
    assert [i["severity"] for i in found] == ["warning", "error"] and found[1]["action"] == "rollback"
    assert all(i["origin_ranks"] == [1] and i["pre_reduction"][0]["name"] == FC1 for i in found)
    assert [i["megatron_rerun"]["verdict"] for i in found] == ["transient", "transient"]
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]
    text = report_text(tmp_path)
    assert ("rolled back to the healthy checkpoint of step 2, learning rate x0.5; iteration(s) 4, 5 skipped on "
            "resuming; restart 1 (1 rollback(s) used in this job)") in text, text  # no safe mode configured


# --- fp16: the loss scaler's skips are its own business (issue 29) -------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc,flags", [(2, ("--use-distributed-optimizer",)), (2, ()),
                                         pytest.param(1, (), marks=pytest.mark.slow)],  # make test-all
                         ids=["dp2-distopt", "dp2", "1rank"])
def test_fp16_clean_run_calibrates_without_a_record(loop_kind, request, tmp_path, nproc, flags):
    """Megatron's defaults (initial loss scale 2^32, fp16 gradient buffers): the scaler skips its
    first iterations while the scale comes down, and the scaled overflow is in every rank's own
    gradients before the reduction. With --loss-scale-window 20 the scale then doubles after each 20
    clean iterations and overflows again: routine skips after the calibration. None of it is an
    origin or an incident: 80 iterations, exit 0, no record, the loss falls."""
    loop = replace(make_loop(loop_kind, request, tmp_path, only="pretrain"), nproc=nproc)
    proc = loop.run(guard_env(tmp_path), "--fp16", "--train-iters", "80", "--loss-scale-window", "20", *flags)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert incidents(tmp_path) == []
    logged = iterations(output)
    assert sorted(logged) == list(range(1, 81))
    skipped = [i for i, line in logged.items() if re.search(r"number of skipped iterations:\s+[1-9]", line)]
    calibrated = min(i for i in logged if i not in skipped)  # the first iteration applied
    assert 1 in skipped and any(i > calibrated for i in skipped), skipped  # calibration, then routine skips
    loss = {i: float(m.group(1)) for i, line in logged.items() if (m := re.search(r"lm loss: ([^ ]+)", line))}
    assert loss[80] < loss[calibrated] - 0.1, (loss[calibrated], loss[80])


@pytest.mark.multiproc
def test_fp16_persistent_nan_collapses_the_scale_and_is_named_with_its_origin(loop_kind, request, tmp_path):
    """A NaN in rank 1's own fc1 gradient from iteration 30 on: the scaler skips and halves its
    scale each time. Ten skips after calibration are a warning; the collapse to the scale's floor
    is an incident too, named on rank 1 with the scale history, and persisting it rolls back."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = guard_env(tmp_path, inject=[f"nan:step=30,count=100,rank=1,phase=local,param={FC1}"])
    proc = loop.run(env, "--fp16", "--use-distributed-optimizer", "--train-iters", "80")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 84, output[-4000:]  # rollback asked, no checkpoint to use
    found = incidents(tmp_path)
    assert [i["kind"] for i in found] == ["loss_scale"] * len(found) and len(found) >= 2, found
    assert all(i["first"]["name"] == FC1 and i["origin_ranks"] == [1] for i in found)
    assert all(i["pre_reduction"][0]["ranks"]["global"] == 1 for i in found)
    run_of_skips, collapse = found[0], next(i for i in found if "collapsed" in i["message"])
    assert run_of_skips["step"] == 39 and run_of_skips["severity"] == "warning"
    assert run_of_skips["message"].startswith("10 consecutive overflow skips")
    history = collapse["loss_scale"]["history"]
    assert history == sorted(history, reverse=True) and history[-1] == collapse["loss_scale"]["scale"] == 1.0
    assert found[-1]["action"] == "rollback" and found[-1]["severity"] == "error"


@pytest.mark.multiproc
def test_fp16_constant_loss_scale_overflow_is_an_incident(loop_kind, request, tmp_path):
    """--loss-scale 128: nothing adapts, so a NaN on rank 1 is a fault like any other: named, origin
    rank 1, warning; the job goes on to its last iteration."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = guard_env(tmp_path, inject=[f"nan:step=5,rank=1,phase=local,param={FC1}"])
    proc = loop.run(env, "--fp16", "--loss-scale", "128", "--no-check-for-nan-in-loss-and-grad", "--train-iters", "8")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["severity"]) == (5, "loss_scale", "warning")
    assert incident["message"].startswith("overflow with a constant loss scale (128)")
    assert incident["first"]["name"] == FC1 and incident["origin_ranks"] == [1]
    assert incident["loss_scale"] == {"scale": 128.0, "dynamic": False, "skips": 1, "history": [128.0]}
    assert sorted(iterations(output)) == list(range(1, 9))


# --- optimizer variants and checkpoint kinds (issue 12, items 4 and 5) ---------------------------


@pytest.mark.multiproc
def test_a_refused_variant_stops_the_job_before_its_model_is_built_with_exit_2_and_one_line(
        loop_kind, request, tmp_path):
    """A variant the guard does not check yet (here the flex token dispatcher, DeepEP/HybridEP)
    stops the job before the model is built and before the first iteration: exit code 2, one line
    on rank 0 naming the flag and why, no worker traceback."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = {**guard_env(tmp_path), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = loop.run(env, "--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
                    "--moe-token-dispatcher-type", "flex", process=True)  # torchrun's summary is read
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(r"exitcode\s*: 2\b", output), output[-4000:]
    refusals = [line for line in output.splitlines() if "is not supported by megatron_patches yet" in line]
    assert len(refusals) == 1 and "--moe-token-dispatcher-type flex" in refusals[0], refusals
    assert "CUDA-only" in refusals[0]
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output
    assert iterations(output) == {}


@pytest.mark.slow  # make test-all: about 70 s on 2 CPU cores; the harness fences in the default run (test_cause.py)
@pytest.mark.multiproc
def test_a_device_whose_adam_state_goes_bad_twice_is_fenced_across_a_restart_with_88(loop_kind, request, tmp_path):
    """Megatron-LM's loop, DP2 bf16 with the distributed optimizer, under the launcher: a NaN written into rank 0's
    exp_avg_sq at iteration 3 is hardware (no iteration skipped, none blacklisted) and rolls back by restart; the
    ledger carries the device's count into the restarted job, where the second corruption (iteration 9) fences it:
    every rank exits 88, one line names the host and device, and the launcher stops with 88 instead of restarting."""
    loop, save = make_loop(loop_kind, request, tmp_path, only="pretrain"), tmp_path / "ckpt"
    drills = [f"nan:step={step},phase=state,slot=exp_avg_sq,param={FC1},rank=0" for step in (3, 9)]
    command = loop.command("--save", str(save), "--load", str(save), "--save-interval", "2", "--train-iters", "14",
                           "--bf16", "--use-distributed-optimizer", *loop.checkpoint_format())
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "3", "--", *command], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900, cwd=REPO, env=guard_env(tmp_path, inject=drills))
    assert proc.returncode == 88, proc.stdout[-6000:]
    records = incidents(tmp_path)
    assert {r["cause"]["class"] for r in records} == {"hardware"} and records[-1]["action"] == "fence"
    device = records[-1]["cause"]["devices"][0]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[megatron_patches] fence: exclude")]
    assert lines == [f"[megatron_patches] fence: exclude host {device['host']} device {device['device']} (rank 0): "
                     f"2 hardware-class incidents in this job, at steps [5, 11]; every rank exits with 88"], lines
    assert "[restart_on_rollback] attempt 2: fence: exclude host" in proc.stdout and "attempt 3" not in proc.stdout
    ledger = Ledger.load(str(save))
    assert ledger.blacklist == [] and ledger.events[0]["skip_iterations"] == [] and ledger.fenced["incidents"] == 2


@pytest.mark.multiproc
def test_a_poison_drill_megatron_lms_loop_cannot_feed_is_refused_at_start_with_one_line(loop_kind, request, tmp_path):
    """Megatron-LM's loop asks the guard for no poisoned sample, so ``poison:sample=10`` would train every
    iteration with no record and no word (measured on the packaged 0.19.2, DP2): the first step refuses it,
    one line on rank 0 naming the drill and what to use instead, exit 2, no iteration done."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, inject=["poison:sample=10"]))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-4000:]
    lines = [line for line in output.splitlines() if "cannot act" in line]
    assert lines == ["[megatron_patches] drill(s) 'poison:sample=10' cannot act: this training loop feeds no poisoned "
                     "sample (the tiny-GPT harness does; Megatron-LM's loop does not); rehearse a bad batch with an "
                     "input drill instead, e.g. bitflip:step=3,phase=input,module=embedding.word_embeddings,bit=30"], lines
    assert "Traceback" not in output and iterations(output) == {} and incidents(tmp_path) == []


@pytest.mark.multiproc
def test_a_misspelled_config_key_is_one_line_and_exit_2_on_every_rank(loop_kind, request, tmp_path):
    """At a thousand ranks a traceback per rank buries the cause, and a restarting launcher would
    retry input that never changes: one line on rank 0, every worker exits 2, nothing trains."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = guard_env(tmp_path, detectors={"nonfinit": {}})
    proc = loop.run(env, process=True)  # what torchrun shows of it is the subject
    output = proc.stdout + proc.stderr
    # Each worker exits 2 unless torchrun, seeing the first one go, tears it down first (SIGTERM, -15).
    codes = set(re.findall(r"exitcode\s*: (-?\d+)", output))
    assert "2" in codes and codes <= {"2", "-15"}, output[-4000:]
    lines = [line for line in output.splitlines() if "unknown config key" in line]
    assert lines == ["[megatron_patches] unknown config key detectors.nonfinit at detectors; valid keys: "
                     "activations, audit, consistency, history, loss_scale, magnitude, nonfinite, peak, peers, tokens"], lines
    assert "Traceback" not in output.split("failed (exitcode")[0]  # torchrun's own summary follows
    assert iterations(output) == {}


@pytest.mark.multiproc
def test_a_ledger_nobody_can_apply_is_one_line_and_exit_2_before_the_first_iteration(loop_kind, request, tmp_path):
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LEDGER_FILE).write_text('{"schema": "megatron_patches.ledger/1", "lr_scale": NaN, "rollbacks": 1}')
    proc = loop.run(guard_env(tmp_path), "--save", str(save), "--load", str(save), "--save-interval", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-4000:]
    [line] = [line for line in output.splitlines() if LEDGER_FILE in line and "`lr_scale`" in line]
    assert line.startswith("[megatron_patches] ledger ") and "move it away" in line
    assert "Traceback" not in output and iterations(output) == {}


@pytest.mark.multiproc
def test_the_harness_retention_key_is_refused_in_megatron_lms_loop(loop_kind, request, tmp_path):
    """keep_checkpoints is the harness's: in Megatron-LM's loop the guard deletes no checkpoint, so a
    job that sets it would believe in a retention nobody applies (issue 25 saw 4 kept with 3)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, recovery={"keep_checkpoints": 3}))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output[-4000:]
    [line] = [line for line in output.splitlines() if "keep_checkpoints" in line and "harness" in line]
    assert line.startswith("[megatron_patches] recovery.keep_checkpoints is the tiny-GPT harness's retention")
    assert iterations(output) == {}


@pytest.mark.multiproc
def test_tensor_parallel_names_the_parameter_and_its_tensor_parallel_rank(loop_kind, request, tmp_path):
    """TP2 through Megatron-LM's own loop (its validation asks CUDA for the device arch: the CPU
    runtime answers a Hopper part's, so CUDA_DEVICE_MAX_CONNECTIONS=1 is needed as on such GPUs).
    A NaN in rank 1's half of the QKV weight's gradient: named with tp rank 1, skipped, the job ends."""
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = {**guard_env(tmp_path, inject=[f"nan:step=3,rank=1,param={qkv}"]), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = loop.run(env, "--tensor-model-parallel-size", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["action"]) == (3, "nan", "skip_step")
    assert incident["first"]["name"] == qkv and incident["first"]["layer"] == 1
    assert {k: incident["first"]["ranks"][k] for k in ("global", "tp", "dp")} == {"global": 1, "tp": 1, "dp": 0}
    assert incident["first"]["shape"] == [96, 64]  # rank 1's half of the 3 x 64 QKV rows
    assert "number of skipped iterations:   1" in iterations(output)[3] and sorted(iterations(output)) == list(range(1, 7))


@pytest.mark.multiproc
@pytest.mark.parametrize("check", [(), ("--no-check-for-nan-in-loss-and-grad",)], ids=["stock", "guard-owns"])
def test_sequence_parallel_names_the_tp_rank_where_a_norm_gradient_broke_not_both(loop_kind, request, tmp_path, check):
    """TP2 with --sequence-parallel (the CPU runtime's stand-in norm marks its weights sequence
    parallel, as Apex's and Transformer Engine's norms do). Megatron all-reduces those weights'
    gradients over the TP group in finalize_model_grads, so a NaN in rank 1's input_layernorm
    gradient is on both TP ranks by the check; the origin pass before it names rank 1 alone,
    with Megatron's check on and with the guard owning the step."""
    norm = "decoder.layers.1.input_layernorm.weight"
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = {**guard_env(tmp_path, inject=[f"nan:step=3,rank=1,phase=local,param={norm}"]), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = loop.run(env, "--tensor-model-parallel-size", "2", "--sequence-parallel", *check)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["severity"], incident["origin_ranks"]) == (3, "warning", [1])
    assert incident["first"]["name"] == norm and incident["first"]["ranks"]["tp"] == 1
    if check:  # the guard's own check after finalize_model_grads sees it on both TP ranks
        assert incident["ranks_affected"] == [0, 1]
    assert sorted(iterations(output)) == list(range(1, 7))


@pytest.mark.multiproc
def test_tp_pp_and_virtual_stages_together_name_the_rank_and_the_chunk(loop_kind, request, tmp_path):
    """4 ranks: TP2 x PP2, one layer per virtual stage (global layer 2 is pipeline rank 0's second
    chunk), sequence parallel, the guard owning the step. A NaN in rank 1's (tp 1) layer-2 norm
    gradient reaches rank 0 through the TP reduction; the origin is rank 1, with pp 0 and vpp 1."""
    if loop_kind == "checkout":
        pytest.skip("core_v0.16.1 on CPU: TP2 with an interleaved schedule trains non-deterministically and "
                    "sometimes NaN from iteration 1 without the guard (docs/megatron_lm.md, known issues)")
    norm = "decoder.layers.2.input_layernorm.weight"
    loop = replace(make_loop(loop_kind, request, tmp_path, only="pretrain"), nproc=4)
    env = {**guard_env(tmp_path, inject=[f"nan:step=3,rank=1,phase=local,param={norm}"]), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = loop.run(env, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8", "--sequence-parallel",
                    "--no-check-for-nan-in-loss-and-grad")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["severity"], incident["origin_ranks"]) == (3, "warning", [1])
    assert incident["first"]["name"] == norm and incident["first"]["layer"] == 2
    assert {k: incident["first"]["ranks"][k] for k in ("tp", "pp", "vpp")} == {"tp": 1, "pp": 0, "vpp": 1}
    assert incident["ranks_affected"] == [0, 1]
    assert sorted(iterations(output)) == list(range(1, 7))


@pytest.mark.multiproc
def test_interleaved_pipeline_names_the_parameter_on_its_virtual_stage(loop_kind, request, tmp_path):
    """Interleaved (virtual) pipeline is checked: PP 2 x VPP 2 over 4 layers puts global layer 2
    on pipeline rank 0 (its second model chunk); a NaN there is named with its global layer
    number, pipeline rank and virtual pipeline rank (the chunk's, not the one running when the
    check ran), and skipped."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    name = "decoder.layers.2.mlp.linear_fc1.weight"
    env = guard_env(tmp_path, inject=[f"nan:step=3,param={name}"])
    proc = loop.run(env, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--num-layers-per-virtual-pipeline-stage", "1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert incident["step"] == 3 and incident["kind"] == "nan" and incident["action"] == "skip_step"
    assert incident["first"]["name"] == name and incident["first"]["layer"] == 2
    assert incident["first"]["ranks"]["pp"] == 0 and incident["first"]["ranks"]["vpp"] == 1
    assert sorted(iterations(output)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.multiproc
def test_a_marker_that_cannot_be_written_never_ends_the_job(loop_kind, request, tmp_path):
    """The guard's files beside a checkpoint fail to write (a directory already stands where the
    marker and rank 0's state file go): the job trains on, that checkpoint is no rollback target,
    the next one is marked healthy."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    blocked = save / "iter_0000002"
    (blocked / checkpoint.MARKER).mkdir(parents=True)
    (blocked / megatron_lm.STATE_DIR / "rank_00000.json").mkdir(parents=True)
    proc = loop.run(guard_env(tmp_path), "--save", str(save), "--save-interval", "2", "--train-iters", "4",
                    *loop.checkpoint_format())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "checkpoint iteration 2 could not be marked" in output and "guard state" in output
    assert sorted(iterations(output)) == [1, 2, 3, 4]
    marker = json.loads((save / "iter_0000004" / checkpoint.MARKER).read_text())
    # Healthy, and no rollback target yet: the job ended before a checked step after it could certify it.
    assert (marker["healthy"], marker["certified_at"]) == (True, None)
    assert {step: ok for step, _, ok in checkpoint.list_checkpoints(str(save))} == {4: False}


def test_a_checkpoint_is_a_target_once_the_checked_steps_after_it_came_out_clean(loop_kind, request, tmp_path):
    """recovery.certify_steps (default 1), issue 38 item 3: iteration 2's checkpoint is certified by
    the clean check of 3; 4's is not, iteration 5 was flagged first; 6 holds that incident; 8, the
    job's last, waits, and a resumed job certifies it with its first clean check (9)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    env = guard_env(tmp_path, inject=[f"nan:step=5,param={FC1}"])
    proc = loop.run(env, "--save", str(save), "--save-interval", "2", "--train-iters", "8", *loop.checkpoint_format())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    def markers() -> dict:
        return {int(d.name[5:]): json.loads((d / checkpoint.MARKER).read_text()) for d in save.glob("iter_*")}

    found = markers()
    assert (found[2]["healthy"], found[2]["certified_at"]) == (True, 3)
    assert (found[4]["healthy"], found[4]["certified_at"]) == (False, None)
    assert found[4]["not_certified"] == "step 5 was flagged before the checkpoint was certified"
    assert found[6]["healthy"] is False and "certified_at" not in found[6]  # the incident of 5 since 4
    assert (found[8]["healthy"], found[8]["certified_at"]) == (True, None)
    assert megatron_lm.newest_healthy_iteration(str(save)) == 2

    resumed = loop.run(env, "--save", str(save), "--load", str(save), "--save-interval", "100", "--train-iters", "10",
                       "--override-opt_param-scheduler", *loop.checkpoint_format())
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert markers()[8]["certified_at"] == 9
    assert megatron_lm.newest_healthy_iteration(str(save)) == 8  # the final save of 10 waits in turn


# --- a NaN in the loss with stock flags: Megatron's loss check and rerun (issue 12, items 1 and 3) ------

FORWARD_NAN = "nan:step=4,rank=1,phase=forward,module=decoder.layers.1.mlp"


def test_megatron_rerun_fields_take_the_reproducible_verdict_and_name_the_loss_ranks():
    """Rank 0 merges every rank's share: one rank that reproduced its fault makes the step's
    verdict reproducible; the ranks whose loss was rejected are named in the message."""
    share = {"mode": "validate_results", "check": "loss", "message": "found NaN in local forward loss"}
    everyone = [RankReport(ranks={"global": 0}, megatron={"rerun": {**share, "check": "bucket norm", "verdict": "transient"}}),
                RankReport(ranks={"global": 1}, megatron={"loss_nonfinite": True, "rerun": {**share, "verdict": "reproducible"}}),
                RankReport(ranks={"global": 2})]
    fields, note = rerun_machine.record_fields(everyone, {})
    assert fields["loss_nonfinite"] is True
    assert fields["megatron_rerun"]["verdict"] == "reproducible" and fields["megatron_rerun"]["mode"] == "validate_results"
    assert [(r["rank"], r["check"], r["verdict"]) for r in fields["megatron_rerun"]["by_rank"]] == [
        (0, "bucket norm", "transient"), (1, "loss", "reproducible")]
    assert "the loss was non-finite on rank(s) [1]" in note and "named first is not the suspect" in note
    assert "found it reproducible" in note
    # all_gradients_nonfinite's message already disclaims the parameter named first.
    _, note = rerun_machine.record_fields(everyone, {"all_gradients_nonfinite": True})
    assert "not the suspect" not in note
    assert rerun_machine.record_fields(everyone[2:], {}) == ({}, "")


@pytest.mark.multiproc
def test_stock_flags_loss_nan_on_one_rank_is_the_guards_incident_with_megatrons_verdict(loop_kind, request,
                                                                                      tmp_path):
    """Rank 1's forward pass goes NaN at iteration 4 (so does its loss): Megatron's loss check
    reruns the step in place, finds it reproducible and, not fatal on a checked step, carries on
    instead of saving a checkpoint and exiting 16. The guard skips the step; the record says the
    loss was non-finite, that the parameter named first is not the suspect, and, from the forward
    pass the guard watched during Megatron's rerun, which module's output went non-finite first."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, inject=[FORWARD_NAN]))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Need to rerun step" in output and "Saving a checkpoint and exiting now" not in output
    [incident] = incidents(tmp_path)
    assert incident["step"] == 4 and incident["action"] == "skip_step" and incident["severity"] == "warning"
    assert incident["origin_ranks"] == [1]
    assert incident["loss_nonfinite"] is True and incident["all_gradients_nonfinite"] is True
    assert "the loss was non-finite on rank(s) [1]" in incident["message"]
    assert "named first is not the suspect" in incident["message"]
    assert incident["megatron_rerun"]["verdict"] == "reproducible"
    [rerun] = incident["megatron_rerun"]["by_rank"]
    assert rerun["rank"] == 1 and rerun["check"] == "loss" and "NaN" in rerun["message"]
    assert incident["forward_origin"] == {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [1]}
    assert "first went non-finite at the output of decoder.layers.1.mlp (layer 1) on rank(s) [1]" in incident["message"]
    _, entered, _, done = diagnosis(incident)
    assert entered.startswith("  entered at: the forward pass, output of decoder.layers.1.mlp (layer 1) on rank(s) [1], "
                              "found by Megatron's rerun in place"), entered
    assert "Megatron's rerun in place: reproducible" in done
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "number of skipped iterations:   1" in logged[4]
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (5, 6)]
    assert all(loss == loss and loss < 100 for loss in losses), losses


@pytest.mark.multiproc
def test_without_megatrons_check_a_loss_nan_is_named_at_its_module_by_the_guards_replay(loop_kind, request,
                                                                                      tmp_path):
    """--no-check-for-nan-in-loss-and-grad: nothing in Megatron reruns the step, every gradient goes
    NaN and the guard skips the step. It then replays the step's forward pass (the micro-batches
    Megatron's RerunDataIterator kept, forward only) and the record names the module whose output
    went non-finite first, on its rank, as with Megatron's check on (issue 28)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, inject=[FORWARD_NAN]), "--no-check-for-nan-in-loss-and-grad")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Need to rerun step" not in output
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["severity"]) == (4, "skip_step", "warning")
    assert incident["all_gradients_nonfinite"] is True and "megatron_rerun" not in incident
    assert incident["forward_origin"] == {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [1]}
    _, entered, _, _ = diagnosis(incident)
    assert entered.startswith("  entered at: the forward pass, output of decoder.layers.1.mlp (layer 1) on rank(s) [1], "
                              "found by the replay"), entered
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and "number of skipped iterations:   1" in logged[4]
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (5, 6)]
    assert all(math.isfinite(loss) and loss < 100 for loss in losses), losses


@pytest.mark.multiproc
def test_loss_nan_on_a_step_the_guard_does_not_check_is_left_to_megatron(loop_kind, request, tmp_path):
    """check_interval 5: iteration 4 is not checked, so Megatron's loss check acts as without the
    guard (reproducible: a checkpoint and exit 16) and the guard records no incident; Megatron's
    exit goes into the ledger with the drill spent. The restart Megatron asks for loads its
    checkpoint with the guard's state. Its rerun of iteration 4 would run on the node and device
    of the first one, where Megatron only asks for another restart ("Got rescheduled on the same
    GPU", exit 16 at every restart: measured before the guard stepped in): the guard leaves that
    rerun undone, skips iteration 4 and the job finishes, the skip kept in the ledger."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    env = guard_env(tmp_path, inject=[FORWARD_NAN], check_interval=5)
    proc = loop.run(env, "--save", str(save), "--save-interval", "100", *loop.checkpoint_format())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 16, output[-4000:]
    assert "Saving a checkpoint and exiting now" in output
    assert incidents(tmp_path) == []
    ledger = Ledger.load(str(save))
    assert ledger.events == [{"step": 4, "megatron_exit": 16, "state": "WILL_RERUN_FROM_CHECKPOINT"}], ledger.events
    assert ledger.rollbacks == 0 and ledger.spent_injections == [FORWARD_NAN]

    again = loop.run(env, "--save", str(save), "--load", str(save), "--save-interval", "100",
                     *loop.checkpoint_format())
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert "guard state of iteration 3 restored" in output
    assert ("Megatron's rerun of iteration 4 from its checkpoint would run on the node and device of its "
            "first rerun") in output
    assert "Got rescheduled on the same GPU" not in output
    logged = iterations(output)
    assert sorted(logged) == [5, 6] and incidents(tmp_path) == []
    assert all(math.isfinite(float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1))) for i in (5, 6)), logged
    assert Ledger.load(str(save)).events[1:] == [
        {"step": 4, "megatron_rerun": "left: same node and device", "skip_iterations": [4]}]


@pytest.mark.multiproc
def test_a_bucket_nan_on_a_step_the_guard_does_not_check_ends_with_megatrons_17_in_the_ledger(loop_kind, request,
                                                                                               tmp_path):
    """check_interval 5: a NaN in rank 1's own gradient at iteration 4 (once: Megatron's rerun in
    place is clean) meets Megatron's per-bucket check on a step the guard does not own. Megatron
    calls it a transient fault it cannot continue from (exit 17, no checkpoint); the guard records
    no incident, and Megatron's exit goes into the ledger with the drill spent."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    drill = f"nan:step=4,rank=1,phase=local,param={FC1}"
    proc = loop.run(guard_env(tmp_path, inject=[drill], check_interval=5), "--save", str(save),
                    "--save-interval", "100", *loop.checkpoint_format())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 17, output[-4000:]
    assert "Possible transient error" in output and incidents(tmp_path) == []
    ledger = Ledger.load(str(save))
    assert ledger.events == [{"step": 4, "megatron_exit": 17, "state": "RERUNNING_IN_PLACE"}], ledger.events
    assert ledger.rollbacks == 0 and ledger.spent_injections == [drill]


@pytest.mark.multiproc
def test_token_ids_outside_the_vocabulary_from_one_rank_are_named_there_in_megatrons_loop(loop_kind, request,
                                                                                         tmp_path):
    """Megatron-LM's own batches: rank 1's token ids at iteration 3 get bit 30 flipped in one place
    (``phase=input``). The word embedding's pre-hook (``detectors.tokens``) counts it, hands the
    lookup 0 instead, and the step is skipped with rank 1 named; Megatron's loop trains on."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    drill = "bitflip:step=3,rank=1,phase=input,module=embedding.word_embeddings,bit=30,scope=element"
    proc = loop.run(guard_env(tmp_path, inject=[drill]))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "fired into the token ids fed to embedding.word_embeddings on rank 1: changed 1 of" in output
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["action"]) == (3, "vocab", "skip_step")
    assert incident["origin_ranks"] == [1] and incident["first"]["reasons"] == ["input:vocab"]
    assert incident["first"]["name"] == "embedding.word_embeddings.weight"
    assert incident["vocab"]["ids_outside"] >= 1
    logged = iterations(output)
    assert "number of skipped iterations:   1" in logged[3] and sorted(logged)[-1] == 6


@pytest.mark.multiproc
def test_an_activation_x1000_on_one_rank_is_named_at_its_module_in_megatrons_loop(loop_kind, request, tmp_path):
    """``detectors.activations`` in Megatron-LM's own loop (DP2): rank 1's MLP output of layer 1
    multiplied by 1,000 at iteration 25 stays finite; the module and the rank are named, the step
    skipped, and the loop trains on."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    drill = "scale:step=25,rank=1,phase=forward,module=decoder.layers.1.mlp,factor=1000,scope=all"
    env = guard_env(tmp_path, inject=[drill], detectors={"activations": {"enabled": True}})
    proc = loop.run(env, "--train-iters", "26")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["action"]) == (25, "activation", "skip_step")
    assert incident["origin_ranks"] == [1] and incident["first"]["name"] == "decoder.layers.1.mlp"
    assert "number of skipped iterations:   1" in iterations(output)[25]
