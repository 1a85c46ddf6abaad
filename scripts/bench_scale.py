"""The slow path at scale, simulated (issue 25): the guard's check, respond and publish stages
alone, no model forward or backward, on N gloo processes of this machine.

Every rank holds a small stand-in model's gradients (``--params`` tensors) under megatron-core's
FP32Optimizer and a guard made as ``import megatron_patches.apply`` makes it. After three clean
checked steps, step 4 holds a NaN in one tensor of rank 1 only ("one"), or of every rank
("every"), and each rank calls the guard's check as Megatron's ``prepare_grads`` would. Measured
per incident: the wall time of that step (the slowest rank), the bytes of the parts rank 0 took
in beside what every rank's parts would have been, and the files written under the report
directory (the record and the scenes) with the number of ranks that wrote a scene. A clean checked step's time is measured the same way.

    python scripts/bench_scale.py --ranks 8 16 32 64 --out scale.json

The ranks are children forked from one process after the imports (copy-on-write: 64 of them fit
in a few GB); on a machine with fewer cores than ranks the times measure the number of
messages and their ordering, not a network. One JSON line per (ranks, case) is printed as it
finishes, and the whole table is written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch

FAULT_STEP = 4


def _rank_main(world: int, port: int, case: str, report_dir: str, params: int, result: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()

    if not torch.cuda.is_available():  # megatron-core's optimizer asks CUDA: the CPU runtime redirects it
        from megatron_patches.testing import cpu

        cpu.install()
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    from megatron_patches import respond
    from megatron_patches.config import Config
    from megatron_patches.seams import build_monitor

    sizes = {"sent": 0, "every": 0}
    gather = respond.gather_reports

    def measured_gather(obj, reports, bounded, tally=0):
        size = len(pickle.dumps(obj))
        sizes["every"] += size
        sizes["sent"] += size if reports else 0
        return gather(obj, reports, bounded, tally)

    respond.gather_reports = measured_gather
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(params)])
    optimizer = FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), OptimizerConfig(lr=0.0), lambda opt: None)
    monitor = build_monitor(Config.from_dict({"report_dir": report_dir, "grad_history": False, "log_level": "error"}))
    monitor.state.model_chunks.remember(optimizer, [model])
    times = {}
    for step in range(1, FAULT_STEP + 1):
        for index, param in enumerate(model.parameters()):
            param.grad = torch.full_like(param, 1e-3 * (index + 1))
        if step == FAULT_STEP and (case == "every" or rank == 1):
            next(model.parameters()).grad[0, 0] = float("nan")
        torch.distributed.barrier()
        started = time.perf_counter()
        skipped = monitor.after_prepare_grads(optimizer, found_inf=False)
        times[step] = time.perf_counter() - started
        assert skipped == (step == FAULT_STEP), (step, skipped)
    monitor.close()  # scenes and the record on disk
    slowest = torch.tensor([times[FAULT_STEP - 1], times[FAULT_STEP]], dtype=torch.float64)
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    total = torch.tensor([sizes["sent"], sizes["every"]], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    torch.distributed.barrier()  # every rank's scene is written before rank 0 counts the files
    if rank == 0:
        files = sum(len(names) for _, _, names in os.walk(report_dir))
        scene_ranks = len(list(Path(report_dir).glob("scenes/*/rank*")))
        Path(result).write_text(json.dumps({
            "ranks": world, "case": case, "clean_step_s": round(slowest[0].item(), 4),
            "incident_step_s": round(slowest[1].item(), 4), "bytes_to_rank0": int(total[0]),
            "bytes_if_every_rank_sent": int(total[1]), "files": files,
            "scene_ranks": scene_ranks}))
    torch.distributed.destroy_process_group()


def run(world: int, case: str, params: int) -> dict:
    """One simulated incident on ``world`` forked ranks; the row rank 0 wrote."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench_scale.") as scratch:
        result = os.path.join(scratch, "row.json")
        report_dir = os.path.join(scratch, "report")
        sys.stdout.flush()
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.environ["RANK"] = str(rank)
                    _rank_main(world, port, case, report_dir, params, result)
                    code = 0
                except BaseException as error:  # a child never returns into the parent's loop
                    print(f"rank {rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        if any(codes):
            raise SystemExit(f"bench_scale: {world} ranks, case {case}: rank exit codes {codes}")
        return json.loads(Path(result).read_text())


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64], help="world sizes to simulate")
    parser.add_argument("--params", type=int, default=8, help="gradient tensors per rank (64x64 each)")
    parser.add_argument("--out", default="scale.json", help="where the table goes (JSON)")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.ranks):
        parser.error("--ranks: every world size must be at least 2 (the fault is on rank 1)")
    if args.params < 1:
        parser.error("--params must be at least 1")
    import megatron.core.optimizer  # noqa: F401  (imported once, before the ranks are forked)

    import megatron_patches.seams  # noqa: F401

    rows = []
    for world in args.ranks:
        for case in ("one", "every"):
            rows.append(run(world, case, args.params))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
