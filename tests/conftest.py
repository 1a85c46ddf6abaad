"""Shared helpers: run the real tiny-GPT harness (in a fork of this process for one rank, under torchrun
for several) and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Run:
    returncode: int
    output: str
    out: Path

    @property
    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())

    @property
    def incidents(self) -> list[dict]:
        path = self.out / "incidents.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_tiny(out: Path, *args: str, nproc: int = 1, env: dict | None = None, timeout: int = 300,
             process: bool = False) -> Run:
    """Train with the tiny-GPT harness. By default its ranks are children forked from this process
    (:func:`run_forked`), torch, megatron-core and the guard already imported: a two-rank run costs
    about 3 s instead of torchrun's 12 s of start-up, imports and teardown. With ``env`` (a variable
    read at import) or ``process=True`` (what torchrun itself does is under test: its summary, its
    ending of the other ranks) the ranks are fresh processes, ``python -m megatron_patches.tiny_gpt``
    under torchrun when nproc > 1."""
    if env is None and not process:
        from megatron_patches.testing import tiny_gpt

        code, output = run_forked(lambda: tiny_gpt.main(["--out", str(out), *args]), timeout=timeout,
                                  nproc=nproc)
        return Run(code, output, out)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_patches.tiny_gpt"]
    else:
        cmd = [sys.executable, "-m", "megatron_patches.tiny_gpt"]
    cmd += ["--out", str(out), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    full_env.pop("MEGATRON_PATCHES_CONFIG", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(proc.returncode, proc.stdout + proc.stderr, out)


def run_forked(target, timeout: int = 300, nproc: int = 1) -> tuple[int, str]:
    """Call ``target()`` (a training's main) in ``nproc`` children forked from this process, each a
    rank of one world with the variables a launcher sets (RANK, WORLD_SIZE, MASTER_PORT, ...);
    returns one exit code and the ranks' output, interleaved by line in one file as torchrun's is.
    In each child, file descriptors 1 and 2 and Python's streams (the guard's log handler included)
    go to that file, torch runs one intra-op thread as the subprocess runs do, and the child ends
    with ``os._exit`` and target's return code (or a stop's). Whatever a run leaves (patches,
    parallel groups, gloo threads, environment variables) dies with the children: the test process
    stays as it was. ``os._exit`` skips multiprocessing's exit handler, so each child first ends the
    processes it started itself (:func:`end_descendants`; megatron-core's checkpoint writer starts a
    ``multiprocessing`` Manager and its resource tracker, which would otherwise outlive the rank).

    As torchrun does, the first rank to exit non-zero ends the others (SIGTERM, SIGKILL 5 s later);
    here the processes those ranks had started are killed with them. Unlike torchrun, the code
    returned is that rank's own (0 when every rank ended with 0), and a line ``[run_forked] rank R
    exited N`` per failed rank closes the output. After ``timeout`` seconds every child left is
    killed (exit -9)."""
    import signal
    import tempfile
    import time

    import psutil

    from megatron_patches.testing.forked import become_fresh

    _import_what_the_harness_imports()
    port = free_port()
    log_fd, log_path = tempfile.mkstemp(prefix="forked_run.", suffix=".log")
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # a child: never returns into pytest
            code = 1
            try:
                become_fresh(log_fd)
                if nproc > 1:
                    os.environ.update(launch_variables(rank, nproc, port))
                try:
                    code = target()
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                end_descendants()  # nothing of the run is wanted now: killed at once
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)
        pids[pid] = rank
    os.close(log_fd)
    codes: dict[int, int] = {}
    stray: list = []  # what the ranks ended below had started: it would outlive them

    def end_rank(pid: int, sig: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            stray.extend(psutil.Process(pid).children(recursive=True))
        os.kill(pid, sig)

    first_failure = None
    deadline = time.monotonic() + timeout
    kill_at = None
    while len(codes) < nproc:
        for pid, rank in pids.items():
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
                if codes[rank] != 0 and first_failure is None:
                    first_failure = rank
                    for other, other_rank in pids.items():
                        if other_rank not in codes:
                            end_rank(other, signal.SIGTERM)
                    kill_at = time.monotonic() + 5
        now = time.monotonic()
        if now > deadline or (kill_at is not None and now > kill_at):
            for pid, rank in pids.items():
                if rank not in codes:
                    end_rank(pid, signal.SIGKILL)
                    codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                    if first_failure is None:
                        first_failure = rank
            break
        time.sleep(0.02)
    _kill_and_reap(stray)
    output = Path(log_path).read_text(errors="replace")
    os.unlink(log_path)
    if nproc > 1:
        output += "".join(f"[run_forked] rank {rank} exited {code}\n" for rank, code in sorted(codes.items()) if code)
    return (0 if first_failure is None else codes[first_failure]), output


def end_descendants(grace_s: float = 0, keep: frozenset = frozenset()) -> list[str]:
    """End every process below this one but the pids in ``keep``: SIGKILL, or with ``grace_s`` SIGTERM
    first and SIGKILL to what is left that many seconds later; all of them reaped, those that had
    already exited too. Returns ``pid N: command line`` of each that was still running."""
    import psutil

    running, exited = [], []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in keep:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() == psutil.STATUS_ZOMBIE:
                exited.append(proc)
            else:
                running.append((proc, " ".join(proc.cmdline()) or proc.name()))
    if grace_s:
        for proc, _ in running:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        psutil.wait_procs([proc for proc, _ in running], timeout=grace_s)
    _kill_and_reap([proc for proc, _ in running] + exited)
    return [f"pid {proc.pid}: {command}" for proc, command in running]


def _kill_and_reap(processes: list) -> None:
    """SIGKILL to each of ``processes`` (psutil.Process) still there, then wait for them."""
    import psutil

    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(processes, timeout=5)


REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_variables(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What a launcher sets for ``rank`` of a one-node world of ``nproc`` (LAUNCH_VARIABLES)."""
    return dict(zip(LAUNCH_VARIABLES, map(str, (rank, rank, nproc, nproc, "127.0.0.1", port))))


def free_port() -> int:
    """A TCP port nothing on this machine listens on now (for rank 0's store)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_packaged_loop(env: dict, args: list[str], nproc: int = 2, timeout: int = 600) -> tuple[int, str]:
    """Megatron-LM's packaged loop (megatron-core 0.17+) as ``torchrun --nproc-per-node NPROC -m
    megatron_patches.testing.pretrain_cpu ARGS`` would run it under ``env`` from the repository
    root, its ranks forked from this process (:func:`run_forked`); ``--no-guard`` among ``args``
    leaves the guard out as the runner does. Returns the exit code and the ranks' output."""
    import megatron_patches.testing.gpt_loop  # noqa: F401  (megatron.training: imported once, here)

    return run_forked(lambda: _packaged_loop_rank(env, args), timeout=timeout, nproc=nproc)


def _packaged_loop_rank(env: dict, args: list[str]) -> None:
    """One forked rank of the packaged loop: the environment replaced (the launcher's variables
    kept), the guard's opt-in line imported afresh, and the process ended as the runner ends it
    (atexit run, no teardown)."""
    import warnings

    from megatron_patches.testing import pretrain_cpu
    from megatron_patches.testing.process_end import run_then_end

    launch = {key: os.environ[key] for key in LAUNCH_VARIABLES if key in os.environ}
    launch = launch or launch_variables(0, 1, free_port())  # one rank: torchrun's variables all the same
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(launch)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    os.chdir(REPO)
    sys.modules.pop("megatron_patches.apply", None)
    sys.argv = [pretrain_cpu.__file__, *args]
    run_then_end(lambda: pretrain_cpu.main(args))


def _import_what_the_harness_imports() -> None:
    """Import, once in this process, the modules a harness rank imports as it builds and trains,
    so each forked rank starts with them (about 1 s less per run). Importing installs nothing."""
    import importlib

    for name in ("megatron.core.distributed", "megatron.core.models.gpt.gpt_model",
                 "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer",
                 "megatron.core.optimizer_param_scheduler", "megatron.core.pipeline_parallel",
                 "megatron.core.tensor_parallel.random", "megatron_patches.testing.trainer",
                 "megatron_patches.testing.cpu", "megatron_patches.runtime", "megatron_patches.recovery",
                 "megatron_patches.checkpoint"):
        importlib.import_module(name)


TEXT_DATA = ["--data", f"text:{os.path.dirname(os.__file__)}", "--data-max-mib", "4"]
"""The harness's real-text data: byte tokens of the standard library's sources, 4 MiB."""
CLEAN_RUNS = [
    pytest.param(1, ("--precision", "bf16"), id="bf16"),
    pytest.param(1, ("--precision", "fp16"), id="fp16"),
    pytest.param(2, ("--precision", "bf16", "--distributed-optimizer", *TEXT_DATA), id="text-dp2-bf16",
                 marks=pytest.mark.multiproc),
]
"""(ranks, flags) of the short clean trainings an opt-in detector must pass without an incident."""
SWEEP = {"1rank": (1, ()), "tp2": (2, ("--tp", "2")), "pp2": (2, ("--pp", "2")),
         "dp2-distopt": (2, ("--distributed-optimizer",))}
"""The layouts of the slow clean sweep on real text (:func:`clean_text_sweep`)."""


def detectors_config(where: Path, **enabled: bool) -> str:
    """A guard config file under ``where`` switching the named detectors on or off (scenes off, for
    speed); its path, for ``--config``."""
    config = where / "guard.yaml"
    switches = ", ".join(f"{name}: {{enabled: {str(on).lower()}}}" for name, on in enabled.items())
    config.write_text(f"detectors: {{{switches}}}\nscene: {{enabled: false}}\n")
    return str(config)


def clean_incidents(out: Path, config: str, ranks: int, flags: tuple, steps: int = 150, seed: int = 2) -> list:
    """Train clean with the guard's ``config``; (step, kind, message) of every incident (the run must end well)."""
    run = run_tiny(out, "--steps", str(steps), "--seed", str(seed), "--config", config, *flags, nproc=ranks,
                   timeout=1800)
    assert run.returncode == 0 and run.result["steps_completed"] == steps, run.output[-3000:]
    return [(r["step"], r["kind"], r["message"]) for r in run.incidents]


def clean_text_sweep(where: Path, config: str) -> dict:
    """2,400 clean steps on real text, seed 3: every layout of :data:`SWEEP` in bf16 and fp16, 300
    steps each; the incidents of each (layout, precision)."""
    return {(layout, precision): clean_incidents(where / f"{layout}-{precision}", config, ranks,
                                                 (*TEXT_DATA, *flags, "--precision", precision), steps=300, seed=3)
            for layout, (ranks, flags) in SWEEP.items() for precision in ("bf16", "fp16")}


def assert_trained(run: Run, min_drop: float = 0.5) -> dict:
    """The run finished, every parameter on every rank is finite, and loss fell."""
    assert run.returncode == 0, run.output[-3000:]
    result = run.result
    assert result["params_finite"], run.output[-3000:]
    assert result["final_loss"] < result["initial_loss"] - min_drop, result
    return result


def assert_norm_is_megatrons(result: dict, steps: int) -> None:
    """On every step both measured, the guard's total gradient norm is the one Megatron's optimizer
    reported (relative difference <= 1e-5): same gradients, same parameters counted once. On a
    checked step Megatron reports the guard's own total (megatron_patches.seams.served_norm), so this
    holds by construction there; tests/trainings/test_served_norm.py compares it with Megatron's own code."""
    gap = result["grad_norm_vs_megatron"]
    assert gap["steps"] == steps and gap["max_rel_diff"] <= 1e-5, gap


@pytest.fixture
def guard_log(caplog):
    """caplog for the "megatron_patches" logger, also after an earlier test in this process ran
    runtime.install(), which stops that logger from propagating to the root logger."""
    logger = logging.getLogger("megatron_patches")
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(caplog.handler)  # exactly one way in, whatever ran before
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


@pytest.fixture
def clean_patches():
    """Leave no patches or monitor behind for the next test in this process."""
    from megatron_patches import runtime

    runtime.uninstall()
    yield
    runtime.uninstall()


@pytest.fixture(scope="session")
def megatron_lm_dir() -> Path:
    """The Megatron-LM checkout in $MEGATRON_LM_DIR; the test is skipped, saying why, without one
    (CI never has one: Megatron-LM's training code is on no package registry)."""
    value = os.environ.get("MEGATRON_LM_DIR")
    if not value:
        pytest.skip("MEGATRON_LM_DIR not set: point it at a Megatron-LM checkout (core 0.12-0.19 or main)")
    path = Path(value)
    if not (path / "pretrain_gpt.py").is_file():
        pytest.skip(f"MEGATRON_LM_DIR={value} has no pretrain_gpt.py")
    return path


def source_tree(variable: str, needed: str, example: str) -> Path:
    """The source tree named by environment ``variable`` (MINDSPEED_DIR, ...), or a skip saying
    why: unset, or without the file ``needed`` (relative to the tree)."""
    value = os.environ.get(variable)
    if not value:
        pytest.skip(f"{variable} not set: point it at {example}")
    path = Path(value)
    if not (path / needed).is_file():
        pytest.skip(f"{variable}={value} has no {needed}")
    return path


# --- tests that run on one megatron-core line --------------------------------------------------

EVERY_LINE = "MEGATRON_PATCHES_EVERY_LINE"


def _core_minor() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


# --- Megatron's globals, reset around every test (issue 60 item 4) -----------------------------------
# A test that runs Megatron in this process (a rerun-machine check, a session's save hooks) leaves
# Megatron's module globals set; the ranks run_tiny forks from this process would inherit them. Each
# is reset before and after every test, so any order passes; only modules already imported are touched
# (the no-Megatron run imports none).

MEGATRON_GLOBALS = (
    ("megatron.core.parallel_state", "destroy_model_parallel"),  # groups, ranks, the global memory buffer
    ("megatron.core.rerun_state_machine", "destroy_rerun_state_machine"),
    ("megatron.core.num_microbatches_calculator", "destroy_num_microbatches_calculator"),
    ("megatron.training.global_vars", "destroy_global_vars"),  # args, timers, writers, tokenizer (0.17+)
)


def reset_megatron_globals() -> list[str]:
    """Reset each of :data:`MEGATRON_GLOBALS` whose module is imported; the names of those reset."""
    done = []
    for module_name, reset in MEGATRON_GLOBALS:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, reset):
            getattr(module, reset)()
            done.append(f"{module_name}.{reset}")
    return done


@pytest.fixture(autouse=True)
def megatron_globals():
    """Megatron's globals as no test left them, before and after each test; a process group a test
    made in this process and left is destroyed after it."""
    reset_megatron_globals()
    distributed = sys.modules.get("torch.distributed")
    had_group = bool(distributed and distributed.is_available() and distributed.is_initialized())
    yield
    reset_megatron_globals()
    distributed = sys.modules.get("torch.distributed")
    if not had_group and distributed and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def guard_logger():
    """The guard's logger as it was before each test: ``runtime.install()`` gives it a handler of its
    own and stops its propagation (so caplog, on the root logger, sees nothing of a later test)."""
    logger = logging.getLogger("megatron_patches")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level


# --- one shuffled order (issue 60 item 4) ------------------------------------------------------------
# MEGATRON_PATCHES_TEST_SEED=<integer> (or "random", which draws one) runs the modules in a shuffled
# order and each module's tests in a shuffled order within it (a module's fixtures are still made
# once). The seed is printed at the end of the run; the same seed gives the same order.

ORDER_SEED = "MEGATRON_PATCHES_TEST_SEED"
_SEED = pytest.StashKey[int]()


def order_seed(value: str) -> int | None:
    """The seed ``value`` names (None: unset or empty, tests in file order)."""
    if not value:
        return None
    if value == "random":
        return int.from_bytes(os.urandom(4), "big")
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{ORDER_SEED} must be an integer seed or 'random', got {value!r}") from None


def shuffled(items: list, seed: int) -> list:
    """``items`` with their modules in an order drawn from ``seed``, and each module's items too."""
    import random

    draw = random.Random(seed)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(modules.values())
    draw.shuffle(groups)
    for group in groups:
        draw.shuffle(group)
    return [item for group in groups for item in group]


def pytest_report_header(config):
    seed = config.stash.get(_SEED, None)
    return [f"test order: shuffled, {ORDER_SEED}={seed}"] if seed is not None else []


def pytest_collection_modifyitems(config, items):
    """The shuffled order where :data:`ORDER_SEED` asks for one, then: ``one_line`` tests run on the 0.16 line only under ``make test``: what is the same on every
    megatron-core line (the guard's own files, CLI, alerts, detectors' arithmetic, the harness's
    data), and the harness's detection, consistency, recovery, record and forward-origin runs,
    whose scenarios the 0.17+ line trains through Megatron-LM's own loop instead
    (tests/trainings/test_megatron_lm_*.py, tests/trainings/test_moe.py, tests/trainings/test_served_norm.py). ``make test-all``
    (which sets EVERY_LINE) runs them on every line."""
    seed = order_seed(os.environ.get(ORDER_SEED, ""))
    if seed is not None:
        config.stash[_SEED] = seed
        items[:] = shuffled(items, seed)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:  # said now too: a run cut short still tells its order
            reporter.write_line(f"test order: shuffled with {ORDER_SEED}={seed}")
    if os.environ.get(EVERY_LINE) or _core_minor() < (0, 17):
        return
    skip = pytest.mark.skip(reason=f"run on the 0.16 leg only (set {EVERY_LINE}=1 to run here)")
    for item in items:
        if item.get_closest_marker("one_line"):
            item.add_marker(skip)


# --- processes the session leaves behind -----------------------------------------------------------
# A process a test starts and does not end (a rank's helper, a launcher's worker) outlives its parent
# and is handed to init, where nothing sees it. The test process is made the subreaper of everything
# below it (Linux), so such orphans come to it, and at the end of the session every process still
# below it is ended and named in the terminal summary.

_LEFT_BEHIND = pytest.StashKey[list]()
PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config):
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def pytest_sessionfinish(session):
    # Not a leftover: this process's own resource tracker (a test that used the spawn context here),
    # which ends when this process does.
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    own = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    session.config.stash[_LEFT_BEHIND] = end_descendants(grace_s=3, keep=frozenset({own}))


def pytest_terminal_summary(terminalreporter, config):
    seed = config.stash.get(_SEED, None)
    if seed is not None:
        terminalreporter.line(f"test order: shuffled with {ORDER_SEED}={seed} (set it again to rerun this order)")
    left = config.stash.get(_LEFT_BEHIND, [])
    if left:
        terminalreporter.section(f"{len(left)} process(es) left behind by the tests, ended now",
                                 sep="!", red=True, bold=True)
        for line in left:
            terminalreporter.line(line, red=True)
        terminalreporter.line("A test or fixture started these and did not end them: find it by the "
                              "command line (PYTEST_CURRENT_TEST is in their environment).", red=True)
