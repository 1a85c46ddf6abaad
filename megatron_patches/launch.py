"""``megatron-patches launch``: run a training command again when megatron_patches asked for a
rollback, within a budget.

    megatron-patches launch --max-restarts 3 -- \\
        torchrun --nproc-per-node 8 pretrain_gpt.py ... --save /ckpt --load /ckpt

On a rollback decision every rank writes nothing but rank 0's ledger
(``<checkpoint dir>/megatron_patches_ledger.json``) and exits with 84; the next start of the same
command loads the newest healthy checkpoint, skips the incident iterations and lowers the
learning rate (``megatron_patches.seams.megatron_lm.rollback``). A rollback is recognised by:

- the command's exit status being one of ``--restart-on`` (84 by default; add 16 to also restart
  when Megatron's RerunStateMachine asks to resume from its checkpoint), or
- the ledger: torchrun reports failed workers with its own status (1), so when the ledger's
  ``rollback_requested`` is set and its rollback count went up during the attempt, the attempt
  ended in a rollback whatever status the launcher returned.

A fence (a device with ``response.hardware_repeat`` hardware-class incidents: the ledger's
``fenced`` set during the attempt, or the workers' exit 88) is never restarted here: the same node
would meet the same device. The launcher ends with ``--fence-code`` (88) after one line naming the
host and device, so that a scheduler requeues the job without that node
(``scripts/slurm/guarded.sbatch``).

Anything else (success, a stop with 85 or 86, a lost peer's 87, a crash) ends the launcher with
the command's status. A rollback once the restart budget is spent ends it with the rollback's code
(84 also when torchrun reported 1): ``--max-restarts 0`` runs the command once and tells a
scheduler that restarts by exit code whether to (``scripts/slurm/guarded.sbatch``). The ledger's
directory is ``--checkpoint-dir``, else the command's ``--save`` (or ``--load``) argument.
``scripts/restart_on_rollback.py`` is the same launcher for a checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from .decisions import EXIT_FENCE, EXIT_ROLLBACK
from .ledger import LEDGER_FILE

PROG = "megatron-patches launch"
PREFIX = "[restart_on_rollback]"
"""What starts every line the launcher prints (the name of the script it began as; tests and
scripts/bench_rollback.py split its output on it)."""


def say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def checkpoint_dir_of(command: list[str]) -> Optional[str]:
    """The value of ``--save`` (else ``--load``) in a Megatron-LM command line."""
    for flag in ("--save", "--load"):
        for i, arg in enumerate(command):
            if arg == flag and i + 1 < len(command):
                return command[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def read_ledger(directory: Optional[str]) -> dict:
    """The ledger's fields ({} when there is none yet). A ledger that cannot be read, or whose
    ``rollbacks`` / ``rollback_requested`` are unusable, ends this script with exit 2: restarting
    on a corrupt ledger would let the job run with whatever it makes of it."""
    if directory is None:
        return {}
    path = os.path.join(directory, LEDGER_FILE)
    fix = "repair it or move it away (a fresh ledger forgets its blacklist and rollback count), then run again"
    try:
        with open(path, encoding="utf-8") as handle:
            ledger = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or (str(exc).splitlines() or ["empty"])[0]
        say(f"error: ledger {path} cannot be read as JSON ({why}); {fix}")
        sys.exit(2)
    rollbacks = ledger.get("rollbacks", 0) if isinstance(ledger, dict) else None
    if not isinstance(ledger, dict):
        problem = f"holds {type(ledger).__name__}, not an object"
    elif isinstance(rollbacks, bool) or not isinstance(rollbacks, int) or rollbacks < 0:
        problem = f"`rollbacks` must be a non-negative integer, got {json.dumps(rollbacks)}"
    elif not isinstance(ledger.get("rollback_requested"), (dict, type(None))):
        problem = f"`rollback_requested` must be an object or null, got {json.dumps(ledger['rollback_requested'])}"
    else:
        return ledger
    say(f"error: ledger {path}: {problem}; {fix}")
    sys.exit(2)


def run_once(command: list[str]) -> int:
    """Run ``command``; SIGTERM/SIGINT sent to this script are passed on to it."""
    child = subprocess.Popen(command)
    forwarded = {}

    def forward(signum, _frame):
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        forwarded[signum] = signal.signal(signum, forward)
    try:
        return child.wait()
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)


def parse(argv: list[str], prog: Optional[str] = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog=prog or PROG,
        description="Re-run a training command after a megatron_patches rollback (exit 84).",
        usage="%(prog)s [--max-restarts N] [--checkpoint-dir DIR] [--fence-code CODE] [--restart-on CODES] -- COMMAND...")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="N",
                        help="restarts allowed after the first run (default 3)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="where the ledger is (default: the command's --save, else --load)")
    parser.add_argument("--fence-code", type=int, default=EXIT_FENCE, metavar="CODE",
                        help=f"exit code of a fence, response.exit_codes.fence (default {EXIT_FENCE})")
    parser.add_argument("--restart-on", default=str(EXIT_ROLLBACK), metavar="CODES",
                        help="comma-separated exit codes that mean 'restart me' (default 84)")
    split = argv.index("--") if "--" in argv else len(argv)
    options, unknown = parser.parse_known_args(argv[:split])  # --help ends here, exit 0
    command = argv[split + 1:]
    if split == len(argv):
        parser.error("put the training command after --, e.g. -- torchrun ... pretrain_gpt.py ...")
    if unknown:
        parser.error(f"unrecognized arguments before --: {' '.join(unknown)}")
    if not command:
        parser.error("no command after --")
    if options.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {options.max_restarts}")
    try:
        options.codes = {int(c) for c in options.restart_on.split(",") if c.strip()}
    except ValueError:
        parser.error(f"--restart-on must be comma-separated integers, got {options.restart_on!r}")
    return options, command


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """Run the command after ``--`` until it ends in anything but a rollback, or the budget is spent."""
    options, command = parse(list(sys.argv[1:] if argv is None else argv), prog)
    directory = options.checkpoint_dir or checkpoint_dir_of(command)
    if directory is None:
        say("no --checkpoint-dir and no --save/--load in the command: restarting on exit codes only")
    restarts = 0
    while True:
        before = read_ledger(directory)
        say(f"attempt {restarts + 1}: {' '.join(command)}")
        started = time.time()
        code = run_once(command)
        after = read_ledger(directory)
        requested = after.get("rollback_requested")
        ledger_says = bool(requested) and after.get("rollbacks", 0) > before.get("rollbacks", 0)
        took = f"{time.time() - started:.0f} s"
        fenced = after.get("fenced")
        if isinstance(fenced, dict) and (code == options.fence_code or fenced != before.get("fenced")):
            say(f"attempt {restarts + 1}: fence: exclude host {fenced.get('host')} device {fenced.get('device')} "
                f"({fenced.get('incidents')} hardware-class incidents; exit {code}, {took}); stopping with "
                f"{options.fence_code}")
            return options.fence_code
        if code == 0:
            say(f"attempt {restarts + 1} finished (exit 0, {took})")
            return 0
        if code not in options.codes and not ledger_says:
            say(f"attempt {restarts + 1} exited with {code} ({took}); not a rollback, stopping")
            return code if code > 0 else 128 - code
        why = f"exit {code}" + (
            f"; ledger: rollback {after.get('rollbacks')} requested at iteration "
            f"{requested.get('iteration', requested.get('from_step'))}, lr scale {after.get('lr_scale')}, "
            f"skipping iterations {requested.get('skip_iterations', [])}" if ledger_says else "")
        if restarts >= options.max_restarts:
            ending = code if code in options.codes else EXIT_ROLLBACK  # the rollback's own, not torchrun's 1
            say(f"attempt {restarts + 1}: rollback ({why}) but the restart budget of "
                f"{options.max_restarts} is spent; stopping with {ending}")
            return ending
        restarts += 1
        say(f"attempt {restarts}: rollback ({why}, {took}); restarting ({restarts} of {options.max_restarts})")


