"""Train a tiny Megatron GPT for real: ``python -m megatron_patches.tiny_gpt`` or
``torchrun --nproc-per-node W -m megatron_patches.tiny_gpt --tp T --pp P``.

It builds the model from megatron-core's own parts (parallel_state, GPTModel with the local
layer spec, DistributedDataParallel, get_megatron_optimizer, the pipeline schedules) and
guards it with ``runtime.install(config)``, what ``import megatron_patches.apply`` does in a
Megatron-LM job, before the process group starts. Each rank builds the config in memory from
its own (identical) command line; ``<out>/effective_config.yaml`` records it for people.
Without an accelerator it runs on the CPU with gloo through the CPU test runtime.
Rank 0 prints one line per step and writes ``<out>/result.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import UserError

if TYPE_CHECKING:
    from ..config import Config

PRECISIONS = ("fp32", "bf16", "fp16")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage wall
        raise UserError(f"{message} (see --help)")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = _Parser(prog="python -m megatron_patches.tiny_gpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1); dp = world / (tp*pp)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="parameter precision (default fp32)")
    p.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer state over data parallel")
    p.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="fp16: the dynamic loss scaler's first scale (default 2^32, Megatron-LM's)")
    p.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: a constant loss scale instead of the dynamic scaler (Megatron-LM's --loss-scale)")
    p.add_argument("--check-for-nan-in-grad", action="store_true",
                   help="megatron-core's own per-bucket NaN/Inf check before the data-parallel reduction "
                        "(on by default in Megatron-LM, off in megatron-core; the guard then takes its origin "
                        "flag from that check's norms instead of a read of its own)")
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each bucket group's data-parallel reduction during backward, as soon as its "
                        "gradients are ready (Megatron-LM's --overlap-grad-reduce)")
    p.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per DDP bucket (default: megatron-core's; smaller makes several buckets)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--seed", type=int, default=1234, help="model and data seed (default 1234)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step and DP rank (default 2)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default 128 for synthetic data, 256 for text: byte-level tokens)")
    p.add_argument("--data", metavar="SPEC", default="synthetic",
                   help="synthetic (default: arithmetic sequences) or text:PATH (byte-level tokens of the UTF-8 "
                        "text files in PATH, a file or a directory walked in sorted order)")
    p.add_argument("--data-max-mib", type=float, default=32.0,
                   help="text data: read at most this many MiB (default 32); a line says when it cuts")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--config", metavar="FILE", help="megatron_patches YAML config (default: built-in defaults)")
    p.add_argument("--inject", metavar="SPEC", action="append", default=[],
                   help="fault to inject, e.g. nan:step=5,param=*linear_fc1.weight,rank=1 (repeatable)")
    p.add_argument("--out", metavar="DIR", default="runs/tiny_gpt", help="output directory (default runs/tiny_gpt)")
    p.add_argument("--save-interval", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--save-from", type=int, default=0,
                   help="the first checkpoint's step; the others every --save-interval steps after it (default 0: "
                        "multiples of the interval; a fault campaign's warm-up needs no rollback target)")
    p.add_argument("--recovery", choices=("in-process", "exit"), default="in-process",
                   help="roll back inside this process (default), or exit with code 84 after writing the "
                        "ledger so a launcher restarts with --resume (how pretrain_gpt.py recovers)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest healthy checkpoint under <out>/checkpoints (and its ledger)")
    p.add_argument("--tensorboard-dir", metavar="DIR",
                   help="write loss, lr, the guard's counters and gradient norms to TensorBoard (rank 0)")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (default 0)")
    p.add_argument("--no-guard", action="store_true", help="train without megatron_patches (baseline)")
    args = _parse_with_branch_flags(p, argv)
    if args.data != "synthetic" and not (args.data.startswith("text:") and len(args.data) > len("text:")):
        raise UserError(f"--data must be synthetic or text:PATH, got {args.data!r}")
    text = args.data.startswith("text:")
    if args.vocab is None:
        args.vocab = 256 if text else 128
    elif text and args.vocab < 256:
        raise UserError(f"--vocab must be >= 256 with --data text:... (byte-level tokens), got {args.vocab}")
    if not args.data_max_mib > 0:
        raise UserError(f"--data-max-mib must be > 0, got {args.data_max_mib}")
    for name in ("tp", "pp", "steps", "micro_batches", "micro_batch_size", "layers", "hidden", "heads", "vocab", "seq"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.save_interval < 0 or args.save_from < 0:
        raise UserError(f"--save-interval and --save-from must be >= 0, got {args.save_interval}, {args.save_from}")
    if not 0.0 <= args.dropout < 1.0:
        raise UserError(f"--dropout must be in [0, 1), got {args.dropout}")
    for name in ("initial_loss_scale", "loss_scale"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not args.lr > 0:
        raise UserError(f"--lr must be > 0, got {args.lr}")
    if args.vocab % args.tp:  # megatron-core splits the vocabulary evenly over tensor-parallel ranks
        raise UserError(f"--vocab ({args.vocab}) must be divisible by --tp ({args.tp})")
    if args.hidden % args.heads:
        raise UserError(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    return args


def _parse_with_branch_flags(p: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    """``p`` with the fault campaign's branch flags (:mod:`.branch`), parsed and checked."""
    from .branch import add_arguments, check_arguments

    add_arguments(p)
    args = p.parse_args(argv)
    check_arguments(args)
    return args


def harness_config(args: argparse.Namespace) -> "Config":
    """The guard's config for this run, built once: the ``--config`` file (else
    $MEGATRON_PATCHES_CONFIG, else the defaults) with the ``--inject`` specs added and
    ``report_dir`` set to ``--out`` unless the file sets one (reports can live apart from the
    results and checkpoints, which stay under ``--out``).

    ``<out>/effective_config.yaml`` records it for people, webhook URLs cut to their host
    (mode 0600, as any file that names a webhook). The ranks use the returned object: the whole
    URL never touches the disk."""
    import dataclasses

    import yaml

    from ..config import Config, config_path, read_config_file, redacted
    from ..files import write_text_atomic

    source = config_path(args.config)
    data = read_config_file(source) if source else {}
    base = Config.from_dict(data)
    report_dir = base.report_dir if "report_dir" in data else args.out
    config = base.replace(inject=tuple(base.inject) + tuple(args.inject), report_dir=report_dir)
    os.makedirs(args.out, exist_ok=True)
    # Every rank writes the same content (write_text_atomic's temporary name is per process).
    text = yaml.safe_dump(redacted(_plain(dataclasses.asdict(config))), sort_keys=False, allow_unicode=True)
    write_text_atomic(os.path.join(args.out, "effective_config.yaml"), text, mode=0o600)
    return config


def _plain(value):
    """``dataclasses.asdict`` output with tuples as lists, which YAML's safe dumper writes."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _launch_env(args: argparse.Namespace) -> None:
    """Set the launcher's variables for a plain ``python -m`` (a world of one) and check that
    tp*pp divides the world."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world = int(os.environ["WORLD_SIZE"])
    if world % (args.tp * args.pp):
        raise UserError(f"tp*pp = {args.tp}*{args.pp} does not divide the world size {world}; "
                        f"launch with --nproc-per-node a multiple of {args.tp * args.pp}")


def _select_device(args: argparse.Namespace) -> tuple[str, str]:
    """Claim this rank's accelerator, or install the CPU runtime; returns (device type:
    'cuda', 'npu' or 'cpu', process-group backend)."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): "
                            f"launch at most {torch.cuda.device_count()} rank(s) per node")
        torch.cuda.set_device(local_rank)
        if args.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise UserError("this GPU cannot run bf16; use --precision fp16 or fp32")
        return "cuda", "nccl"
    if _npu_available():
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return "npu", "hccl"
    from . import cpu

    cpu.install()
    return "cpu", "gloo"


def init_distributed(args: argparse.Namespace) -> str:
    """Start torch.distributed without the guard (``scripts/bench_overhead.py`` switches it on
    and off itself); returns the device type ('cuda', 'npu' or 'cpu')."""
    import torch

    _launch_env(args)
    device, backend = _select_device(args)
    torch.distributed.init_process_group(backend=backend)
    return device


def _npu_available() -> bool:
    try:
        import torch_npu  # type: ignore  # noqa: F401
        import torch

        return torch.npu.is_available()  # type: ignore[attr-defined]
    except Exception:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_code(train: Callable[[], dict]) -> int:
    """``train()``'s exit code, the harness's: 0 when the weights ended finite, else 1; 2 with one
    line for a wrong argument; the guard's documented code when it stopped every rank."""
    try:
        result = train()
    except UserError as exc:
        print(f"tiny_gpt: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0 if result["params_finite"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    def train() -> dict:
        args = parse_args(argv)
        config = None if args.no_guard else harness_config(args)
        _launch_env(args)
        device, backend = _select_device(args)
        monitor = None
        if config is not None:
            from ..runtime import install

            monitor = install(config)  # the --inject specs are parsed here, before any process group
        torch.distributed.init_process_group(backend=backend)
        from .trainer import TinyTrainer

        return TinyTrainer(args, device, monitor).train()

    try:
        return exit_code(train)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from .process_end import run_then_end

    run_then_end(main)
