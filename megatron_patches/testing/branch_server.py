"""Many tiny-GPT trainings in one process group, for the fault campaign (issue 55).

A campaign runs thousands of short branches of one warm-up (:mod:`.branch`). Started as a process
each (a fork per rank, a process group, a model, a teardown), a branch on these CPUs cost about as
much to start and end as to train. Here the ranks are forked once (:class:`BranchWorker`, from the
campaign's process, its imports done), start the process group once and then run whatever
trainings they are sent, one after the other, each exactly as ``python -m megatron_patches.tiny_gpt
ARGS`` would:

- the guard is made anew for each training from that training's own ``--config`` and
  ``--inject`` (the patches stay installed: they are the same for every configuration; the
  previous guard is unset first, so none of its counters, baselines or ledger carry over, and its
  hooks sat on the previous model, which is dropped);
- the model, DDP, optimizer, scheduler and sampler are built anew from ``--seed`` (the parallel
  groups and the process group are kept), and a branch then restores the snapshot it names with
  :func:`.branch.load`, as a fresh process does.

Rank 0 talks to the campaign over one TCP connection: one JSON line per
training in (its arguments; ``null`` ends the server), one JSON line out (``code``: what the
process would have exited with, ``output``: rank 0's printed lines). A rank that raises anything
else than a stop ends the whole server, as the training's own process would have ended (a stop
ends it too, having answered: the guard's stop takes the process group down with the run);
:class:`BranchWorker` then starts a new one for the next training.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from .forked import become_fresh


def _training(argv: list[str], device: str) -> int:
    """Run one training as ``tiny_gpt.main(argv)`` would, in this process; its exit code."""
    from ..seams import wrappers
    from ..runtime import install
    from .tiny_gpt import exit_code, harness_config, parse_args
    from .trainer import TinyTrainer

    def train() -> dict:
        args = parse_args(argv)
        config = None if args.no_guard else harness_config(args)
        monitor = install(config) if config is not None else None
        return TinyTrainer(args, device, monitor).train()

    wrappers.set_monitor(None)  # the previous training's guard, with everything it kept
    try:
        return exit_code(train)
    finally:
        wrappers.set_monitor(None)


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
        if not torch.distributed.is_initialized():  # a stop of the guard ended the process group with the run
            if rank == 0:  # every rank stopped with this code; the server ends with them
                channel.write(json.dumps({"code": code, "output": printed.getvalue(), "ends": True}) + "\n")
                channel.flush()
            return 0
        codes = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(codes, code)
        if rank == 0:  # as a launcher of the ranks reports: the first rank's non-zero code
            channel.write(json.dumps({"code": next((c for c in codes if c), 0), "output": printed.getvalue()}) + "\n")
            channel.flush()
    torch.distributed.destroy_process_group()
    return 0


class BranchWorker:
    """The campaign's side: one server of ``nproc`` ranks forked from this process (its imports
    done, as ``tests/conftest.py``'s ``run_forked`` forks a training's ranks), started at the first
    training and again after one ended it; :meth:`run` sends a training and waits for it."""

    def __init__(self, nproc: int, flags: tuple, logdir: Path, start_timeout: int = 600):
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        self.nproc, self.flags, self.logdir, self.start_timeout = nproc, tuple(flags), Path(logdir), start_timeout
        self.starts = 0
        """How many servers this worker started (1 unless a training ended one)."""
        self._pids: list[int] = []
        self._channel: Any = None
        self._socket: Optional[socket.socket] = None

    def _start(self) -> None:
        import importlib

        for name in ("megatron.core.distributed", "megatron.core.models.gpt.gpt_model", "megatron.core.optimizer",
                     "megatron.core.pipeline_parallel", "megatron_patches.runtime", "megatron_patches.recovery",
                     "megatron_patches.testing.trainer", "megatron_patches.testing.cpu"):
            importlib.import_module(name)  # once here, not in every server
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        listener = socket.create_server(("127.0.0.1", 0))
        connect = f"127.0.0.1:{listener.getsockname()[1]}"
        with socket.socket() as probe:  # rank 0's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = os.open(self.logdir / f"server-{self.starts}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(self.nproc):
            pid = os.fork()
            if pid == 0:  # a rank: never returns to the campaign
                code = 1
                try:
                    listener.close()
                    code = _rank(rank, self.nproc, port, log, connect, list(self.flags))
                finally:
                    os._exit(code)
            self._pids.append(pid)
        os.close(log)
        listener.settimeout(1.0)
        deadline = time.time() + self.start_timeout
        while True:
            try:
                connection, _ = listener.accept()
                break
            except socket.timeout:
                if self._gone() or time.time() > deadline:
                    listener.close()
                    self._end()
                    raise RuntimeError(f"the branch server did not start; see {self.logdir}/server-{self.starts}.log")
        listener.close()
        self._socket, self._channel = connection, connection.makefile("rw", encoding="utf-8")

    def _gone(self) -> Optional[int]:
        """The exit code of a rank that ended, or None while all run."""
        for pid in self._pids:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._pids.remove(pid)
                return os.waitstatus_to_exitcode(status)
        return None

    def run(self, argv: list[str], timeout: int) -> tuple[int, str]:
        """Train ``argv`` (``tiny_gpt``'s arguments); its exit code and rank 0's output. After
        ``timeout`` seconds the server is killed and the code is -9, as a killed process's."""
        if not self._pids:
            self._start()
        self._socket.settimeout(timeout)
        try:
            self._channel.write(json.dumps(list(argv)) + "\n")
            self._channel.flush()
            line = self._channel.readline()
        except (socket.timeout, OSError):
            self._end()
            return -9, ""
        if not line:  # a rank raised and ended: the server is gone, with that rank's code
            deadline, code = time.time() + 5, None
            while code is None and time.time() < deadline:
                code = self._gone()
                time.sleep(0.02)
            self._end()
            return code or 1, f"[branch_server] a rank exited {code}; see {self.logdir}/server-{self.starts}.log"
        answer = json.loads(line)
        if answer.get("ends"):  # the training stopped the ranks: the next one starts a new server
            self.close()
        return int(answer["code"]), answer["output"]

    def _end(self) -> None:
        for pid in self._pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._pids = []
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.close()
                self._socket.close()
        self._channel = self._socket = None

    def close(self) -> None:
        """End the server: its ranks leave the process group and exit."""
        if self._pids:
            with contextlib.suppress(OSError):
                self._channel.write("null\n")
                self._channel.flush()
            deadline = time.time() + 60
            while self._pids and time.time() < deadline:
                self._gone()
                time.sleep(0.05)
        self._end()


def _rank(rank: int, nproc: int, port: int, log: int, connect: str, flags: list[str]) -> int:
    """A forked rank: its output to ``log``, a launcher's variables, one intra-op thread (as a
    training's own process has them: ``tests/conftest.py``'s ``run_forked``); then :func:`serve`."""
    become_fresh(log)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        return serve(connect, flags)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
