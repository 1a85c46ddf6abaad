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

from megatron_patches.recovery import Ledger
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS
from test_megatron_lm import FC1, REPO, _packaged_loop_available, guard_env, incidents, iterations

NVRX_PATH = os.environ.get("NVRX_PATH")


@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop_available(), reason="megatron-core ships megatron/training from 0.17 on")
@pytest.mark.skipif(not NVRX_PATH, reason="NVRX_PATH not set: a directory where nvidia_resiliency_ext imports")
def test_ft_launcher_restarts_the_job_after_a_rollback_and_it_resumes_from_the_healthy_checkpoint(tmp_path):
    """ft_launcher --max-restarts 2 around Megatron-LM's packaged loop (2 ranks): a persistent NaN
    makes every rank exit 84 at iteration 4; ft_launcher restarts the worker group in a new
    rendezvous round, Megatron's groups are built again, iteration 2's checkpoint is loaded,
    3 and 4 are skipped, 5 and 6 train at half the learning rate, and the launcher exits 0."""
    save = tmp_path / "ckpt"
    env = {**guard_env(tmp_path, inject=[f"nan:step=3,count=2,param={FC1}"]), "PYTHONPATH": NVRX_PATH}
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
    assert [(i["step"], i["severity"]) for i in incidents(tmp_path)] == [(3, "warning"), (4, "error")]
    assert sorted(iterations(second)) == [5, 6]
    assert all("learning rate: 5.000000E-04" in line for line in iterations(second).values())
    ledger = Ledger.load(str(save))
    assert ledger.rollbacks == 1 and ledger.events[1]["resumed_from"] == 2
    assert Path(save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
