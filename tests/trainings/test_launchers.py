"""The restart contract with launchers other than the project's own (issue 25): a rollback's exit
84, a restart by the launcher, the resume from the healthy checkpoint.

NVRx's ``ft_launcher`` (nvidia-resiliency-ext, what Megatron-LM's ``--enable-ft-package`` runs
under) is on the package registry but pulls a CUDA torch and, installed beside megatron-core
0.19.2, breaks ``import megatron.core.dist_checkpointing`` (its package has no ``__version__``,
which megatron reads): so it is not in CI's environments. Point ``NVRX_PATH`` at a directory
where ``nvidia_resiliency_ext`` imports (e.g. ``pip install --target DIR nvidia-resiliency-ext``);
the launcher runs with it on ``PYTHONPATH``, the workers without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patches.ledger import Ledger
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS
from megatron_lm_loop import FC1, REPO, _packaged_loop_available, guard_env, incidents, iterations

NVRX_PATH = os.environ.get("NVRX_PATH")


@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop_available(), reason="megatron-core ships megatron/training from 0.17 on")
@pytest.mark.skipif(not NVRX_PATH, reason="NVRX_PATH not set: a directory where nvidia_resiliency_ext imports")
def test_ft_launcher_restarts_the_job_after_a_rollback_and_it_resumes_from_the_healthy_checkpoint(tmp_path):
    """ft_launcher --max-restarts 2 around Megatron-LM's packaged loop (2 ranks): a persistent NaN
    makes every rank exit 84 at iteration 5; ft_launcher restarts the worker group in a new
    rendezvous round, Megatron's groups are built again, iteration 2's checkpoint (certified by
    the clean check of 3) is loaded, 3 trains, 4 and 5 are skipped, 6 trains, at half the learning
    rate, and the launcher exits 0."""
    save = tmp_path / "ckpt"
    env = {**guard_env(tmp_path, inject=[f"nan:step=4,count=2,param={FC1}"]), "PYTHONPATH": NVRX_PATH}
    command = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "2",
               "--no-python", "env", "-u", "PYTHONPATH", sys.executable, "-m", "megatron_patches.testing.pretrain_cpu",
               *TINY_GPT_ARGS, "--train-iters", "6", "--save", str(save), "--load", str(save), "--save-interval", "2"]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                          cwd=REPO, env=env)
    output = proc.stdout
    assert proc.returncode == 0, output[-6000:]
    assert "failed (exitcode: 84)" in output and "will restart worker group" in output
    first, second = output.split("will restart worker group", 1)
    assert [(i["step"], i["severity"]) for i in incidents(tmp_path)] == [(4, "warning"), (5, "error")]
    assert sorted(iterations(second)) == [3, 6]
    assert all("learning rate: 5.000000E-04" in line for line in iterations(second).values())
    ledger = Ledger.load(str(save))
    assert ledger.rollbacks == 1 and ledger.events[1]["resumed_from"] == 2
    assert Path(save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


# --- Slurm: scripts/slurm/guarded.sbatch under a stand-in scheduler (no Slurm here) ----------------

SBATCH = REPO / "scripts" / "slurm" / "guarded.sbatch"

STANDIN_SRUN = """#!/bin/sh
# Stand-in for Slurm's srun (no Slurm here): drops srun's own options, runs the one task here.
while [ $# -gt 0 ]; do case "$1" in --*) shift ;; *) break ;; esac; done
exec "$@"
"""

STANDIN_SCONTROL = """#!/bin/sh
# Stand-in for Slurm's scontrol (no Slurm here): 'scontrol requeue JOB' is noted for the stand-in scheduler.
[ "$1" = requeue ] && echo "$2" >> "$SLURM_STANDIN_REQUEUES"
"""


def slurm_standin(tmp_path: Path, command: list[str], env: dict, max_requeues: int = 3) -> list[str]:
    """Stand-in for the Slurm scheduler (no Slurm here): runs the batch script with bash as a
    batch job would, the training command as its arguments, and runs it again, with
    SLURM_RESTART_COUNT one higher, each time the script asked for ``scontrol requeue``. Returns
    each run's output; the last one's exit code is appended as ``[standin] exit N``."""
    tools = tmp_path / "standin-bin"
    tools.mkdir()
    for name, text in (("srun", STANDIN_SRUN), ("scontrol", STANDIN_SCONTROL)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    requeues = tmp_path / "requeues"
    outputs = []
    for restart in range(max_requeues + 2):
        job_env = {**env, "PATH": f"{tools}:{env['PATH']}", "SLURM_JOB_ID": "4242", "MEGATRON_PATCHES_DIR": str(REPO),
                   "MAX_REQUEUES": str(max_requeues), "SLURM_STANDIN_REQUEUES": str(requeues),
                   **({"SLURM_RESTART_COUNT": str(restart)} if restart else {})}
        asked = len(requeues.read_text().split()) if requeues.exists() else 0
        proc = subprocess.run(["bash", str(SBATCH), *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=600, cwd=REPO, env=job_env)
        outputs.append(proc.stdout)
        if (len(requeues.read_text().split()) if requeues.exists() else 0) == asked:
            outputs[-1] += f"[standin] exit {proc.returncode}\n"
            return outputs
    raise AssertionError(f"still requeued after {max_requeues + 2} runs")


def torchrun_loop(save: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "megatron_patches.testing.pretrain_cpu", *TINY_GPT_ARGS, "--train-iters", "6",
            "--save", str(save), "--load", str(save), "--save-interval", "2"]


needs_packaged_loop = pytest.mark.skipif(not _packaged_loop_available(),
                                         reason="megatron-core ships megatron/training from 0.17 on")


# In make test-all: CI keeps the launcher's own restart (test_megatron_lm_restart.py), the same
# exit 84 and resume; this stand-in adds the sbatch script's requeue around it (~22 s quiet).
@pytest.mark.slow
@pytest.mark.multiproc
@needs_packaged_loop
def test_slurm_requeues_a_rollback_and_the_job_resumes_from_the_healthy_checkpoint_standin(tmp_path):
    """guarded.sbatch around torchrun and Megatron-LM's packaged loop, under the stand-in
    scheduler: a persistent NaN makes the job ask for a rollback at iteration 5; torchrun exits 1,
    restart_on_rollback.py reads the ledger and exits 84, the script requeues the job; the requeued
    job loads iteration 2 (certified by the clean check of 3), trains 3, skips 4-5, trains 6 at half
    the learning rate and ends with 0."""
    save = tmp_path / "ckpt"
    env = guard_env(tmp_path, inject=[f"nan:step=4,count=2,param={FC1}"])
    first, second = slurm_standin(tmp_path, torchrun_loop(save), env)
    assert "restart budget of 0 is spent; stopping with 84" in first, first[-4000:]
    assert "[guarded.sbatch] rollback asked (exit 84): requeueing job 4242 (restart 1 of 3)" in first
    assert second.endswith("[standin] exit 0\n"), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]
    assert all("learning rate: 5.000000E-04" in line for line in iterations(second).values())
    ledger = Ledger.load(str(save))
    assert ledger.rollbacks == 1 and ledger.events[1]["resumed_from"] == 2


@pytest.mark.slow  # make test-all: CI keeps the requeue above within its time budget
@pytest.mark.multiproc
@needs_packaged_loop
def test_slurm_never_requeues_a_critical_stop_standin(tmp_path):
    """The same script and stand-in scheduler; a NaN on both data-parallel replicas at iteration 3
    is critical: the workers exit 86, torchrun 1, nothing in the ledger asks for a rollback, so
    the job is not requeued and ends with torchrun's 1."""
    save = tmp_path / "ckpt"
    env = guard_env(tmp_path, inject=[f"nan:step=3,rank=0,phase=local,param={FC1}",
                                      f"nan:step=3,rank=1,phase=local,param={FC1}"])
    [only] = slurm_standin(tmp_path, torchrun_loop(save), env)
    assert only.endswith("[standin] exit 1\n") and "exitcode  : 86" in only, only[-4000:]
    assert not (tmp_path / "requeues").exists() and "[guarded.sbatch]" not in only
    assert [i["severity"] for i in incidents(tmp_path)] == ["critical"]
