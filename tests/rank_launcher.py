"""Start N ranks of the harness as plain processes (no torchrun), so a test can read each
rank's own exit code: torchrun folds them into one."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import free_port, launch_variables


def run_ranks(nproc: int, args: list[str], timeout: int = 300,
              extra_env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run the ranks to the end; ``extra_env`` is added to every rank's environment."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, **launch_variables(rank, nproc, port),
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(extra_env or {})}
        env.pop("MEGATRON_PATCHES_CONFIG", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_patches.tiny_gpt", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    return results
