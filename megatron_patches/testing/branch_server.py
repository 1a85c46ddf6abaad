"""Many tiny-GPT trainings in one process group, for the fault campaign (issue 55).

A campaign runs thousands of short branches of one warm-up (:mod:`.branch`). Started as a process
each (a fork per rank, a process group, a model, a teardown), a branch on these CPUs cost more to
start and end than to train. Here one launch (``python -m megatron_patches.testing.branch_server``,
under torchrun for several ranks) starts the process group once and then runs whatever trainings
it is sent, one after the other, each exactly as ``python -m megatron_patches.tiny_gpt ARGS`` would:

- the guard is made anew for each training from that training's own ``--config`` and
  ``--inject`` (the patches stay installed: they are the same for every configuration; the
  previous guard is unset first, so none of its counters, baselines, ledger or hooks carry over);
- the model, DDP, optimizer, scheduler and sampler are built anew from ``--seed`` (the parallel
  groups and the process group are kept), and a branch then restores the snapshot it names with
  :func:`.branch.load`, as a fresh process does.

Rank 0 talks to the campaign over one TCP connection (``--connect HOST:PORT``): one JSON line per
training in (its arguments; ``null`` ends the server), one JSON line out (``code``: what the
process would have exited with, ``output``: rank 0's printed lines). A rank that raises anything
else than a stop ends the whole server (its launcher ends the others), as the training's own
process would have ended; :class:`BranchWorker` then starts a new one for the next training.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from ..errors import UserError


def _training(argv: list[str], device: str) -> int:
    """Run one training as ``tiny_gpt.main(argv)`` would, in this process; its exit code."""
    from ..runtime import install
    from ..seams import wrappers
    from .tiny_gpt import harness_config, parse_args
    from .trainer import TinyTrainer

    wrappers.set_monitor(None)  # the previous training's guard, with everything it kept
    try:
        args = parse_args(argv)
        config = None if args.no_guard else harness_config(args)
        monitor = install(config) if config is not None else None
        result = TinyTrainer(args, device, monitor).train()
    except UserError as exc:
        print(f"tiny_gpt: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # the guard stopped every rank with a documented code
        return int(exc.code or 0)
    finally:
        wrappers.set_monitor(None)
    return 0 if result["params_finite"] else 1


def serve(connect: str, flags: list[str]) -> int:
    """The server's loop on every rank (``flags``: the layout's harness flags, for the launch)."""
    import torch

    from .tiny_gpt import _launch_env, _select_device, parse_args

    layout = parse_args(flags)
    _launch_env(layout)
    device, backend = _select_device(layout)
    torch.distributed.init_process_group(backend=backend)
    rank = torch.distributed.get_rank()
    channel = None
    if rank == 0:
        host, port = connect.rsplit(":", 1)
        channel = socket.create_connection((host, int(port))).makefile("rw", encoding="utf-8")
    while True:
        job = [json.loads(channel.readline() or "null") if rank == 0 else None]
        torch.distributed.broadcast_object_list(job, src=0)
        if job[0] is None:
            break
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed) if rank == 0 else contextlib.nullcontext():
            try:
                code = _training(list(job[0]), device)
            except BaseException:  # what would have ended the training's process ends this one
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
        codes = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(codes, code)
        if rank == 0:  # as a launcher of the ranks reports: the first rank's non-zero code
            channel.write(json.dumps({"code": next((c for c in codes if c), 0), "output": printed.getvalue()}) + "\n")
            channel.flush()
    torch.distributed.destroy_process_group()
    return 0


class BranchWorker:
    """The campaign's side: one server of ``nproc`` ranks with the layout's ``flags``, started at
    the first training and again after one ended it; :meth:`run` sends a training and waits."""

    def __init__(self, nproc: int, flags: tuple, logdir: Path, start_timeout: int = 600):
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        self.nproc, self.flags, self.logdir, self.start_timeout = nproc, tuple(flags), Path(logdir), start_timeout
        self.starts = 0
        """How many servers this worker started (1 unless a training ended one)."""
        self._process: Optional[subprocess.Popen] = None
        self._channel: Any = None

    def _start(self) -> None:
        import megatron_patches

        self.logdir.mkdir(parents=True, exist_ok=True)
        listener = socket.create_server(("127.0.0.1", 0))
        module = ["-m", "megatron_patches.testing.branch_server", "--connect", f"127.0.0.1:{listener.getsockname()[1]}"]
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}"] if self.nproc > 1 else []
        source = str(Path(megatron_patches.__file__).resolve().parents[1])  # this checkout's package, not another
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
        env.pop("MEGATRON_PATCHES_CONFIG", None)
        self.starts += 1
        log = open(self.logdir / f"server-{self.starts}.log", "w", encoding="utf-8")
        self._process = subprocess.Popen([sys.executable, *launch, *module, "--", *self.flags], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        listener.settimeout(1.0)
        deadline = time.time() + self.start_timeout
        while True:
            try:
                connection, _ = listener.accept()
                break
            except socket.timeout:
                if self._process.poll() is not None or time.time() > deadline:
                    self._end()
                    raise RuntimeError(f"the branch server did not start; see {self.logdir}/server-{self.starts}.log")
        listener.close()
        self._channel = connection.makefile("rw", encoding="utf-8")
        self._socket = connection

    def run(self, argv: list[str], timeout: int) -> tuple[int, str]:
        """Train ``argv`` (``tiny_gpt``'s arguments); its exit code and rank 0's output. After
        ``timeout`` seconds the server is killed and the code is -9, as a killed process's."""
        if self._process is None:
            self._start()
        self._socket.settimeout(timeout)
        try:
            self._channel.write(json.dumps(list(argv)) + "\n")
            self._channel.flush()
            line = self._channel.readline()
        except (socket.timeout, OSError):
            self._end()
            return -9, ""
        if not line:  # a rank raised: the server is gone, with the code its launcher ended with
            code = self._process.wait()
            self._end()
            return code or 1, f"[branch_server] ended with {code}; see {self.logdir}/server-{self.starts}.log"
        answer = json.loads(line)
        return int(answer["code"]), answer["output"]

    def _end(self) -> None:
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.close()
                self._socket.close()
        self._process = self._channel = None

    def close(self) -> None:
        """End the server (it leaves its process group and exits)."""
        if self._process is not None:
            with contextlib.suppress(OSError):
                self._channel.write("null\n")
                self._channel.flush()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self._end()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_patches.testing.branch_server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, metavar="HOST:PORT", help="where the campaign listens")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the layout's harness flags (--tp, --pp, ...)")
    args = p.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    return serve(args.connect, flags)


if __name__ == "__main__":
    from .process_end import run_then_end

    run_then_end(main)
