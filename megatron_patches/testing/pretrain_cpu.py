"""Run Megatron-LM's training loop on a CPU-only torch: a checkout's ``pretrain_gpt.py``, or the
loop the megatron-core package ships (0.17+).

    torchrun --nproc-per-node 2 -m megatron_patches.testing.pretrain_cpu \\
        PATH/TO/Megatron-LM/pretrain_gpt.py --distributed-backend gloo ... (the script's own args)
    torchrun --nproc-per-node 2 -m megatron_patches.testing.pretrain_cpu \\
        --distributed-backend gloo ...                      (Megatron arguments only)

``--no-guard`` (the runner's own flag, anywhere among the arguments) runs the packaged loop without
``import megatron_patches.apply``: the unguarded run a guarded one is compared with.

With a script, its directory goes first on ``sys.path``, so ``megatron`` (core and training) is the
checkout's, source patches included. Then :mod:`megatron_patches.testing.megatron_lm_cpu` installs
the CPU redirects and the script runs as ``__main__`` with ``sys.argv`` set to its own arguments.

Without a script (the first argument is a flag), the installed package's
``megatron.training.pretrain`` trains the GPT of :mod:`megatron_patches.testing.gpt_loop`, guarded
through ``import megatron_patches.apply`` as a user's script would be. On a machine with CUDA it
trains on the GPU (``--distributed-backend nccl``): only the redirects the wheel needs on any
device are installed (``megatron_lm_cpu.install(on_cpu=False)``); ``scripts/gpu_check.py`` runs it so.

Besides torch and megatron-core's own needs, Megatron-LM's training package imports six, regex,
pydantic, psutil and, for some paths, triton. The command line must turn CUDA-only fusions off
(``--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm``) and use
``--transformer-impl local --use-cpu-initialization``.

For tests only; it is not a way to train at speed.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

TINY_GPT_ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
    "--lr 1e-3 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer "
    # core <= 0.15 mock data draws token ids up to 4095.
    "--vocab-size 4096 --transformer-impl local --distributed-backend gloo "
    "--use-cpu-initialization --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm "
    "--eval-iters 0 --eval-interval 1000 --log-interval 1"
).split()
"""A tiny GPT that trains on 2 CPU ranks with gloo (add ``--train-iters N``): the regression
configuration the tests use, and a starting point for CPU-only CI runners."""

USAGE = ("usage: python -m megatron_patches.testing.pretrain_cpu [PATH/pretrain_gpt.py] [MEGATRON ARGS...]\n"
         "  without a script, megatron-core's packaged loop (0.17+) trains megatron_patches' tiny GPT")

WITHOUT_GUARD = "--no-guard"
"""The runner's flag for the packaged loop without the guard (not a Megatron argument)."""

# Import names whose distribution is called otherwise on the package registry.
_DISTRIBUTIONS = {"yaml": "pyyaml", "google.protobuf": "protobuf"}


def _missing_module(exc: ModuleNotFoundError) -> str:
    name = exc.name or str(exc)
    distribution = _DISTRIBUTIONS.get(name, name.split(".")[0])
    return (f"Megatron-LM's training code needs the module {name!r}, which is not installed: "
            f"pip install {distribution}  (or: pip install 'megatron_patches[megatron-lm]')")


def _run_script(script: Path, args: list[str]) -> None:
    if "megatron" in sys.modules:
        raise SystemExit(
            f"megatron was imported before the runner set sys.path for {script.parent}; "
            "run this module directly (python -m / torchrun -m)"
        )
    sys.path.insert(0, str(script.parent))

    from megatron_patches.testing import megatron_lm_cpu, step_probe

    megatron_lm_cpu.install()
    if os.environ.get(step_probe.ENV):
        step_probe.install(os.environ[step_probe.ENV])
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def _run_packaged(args: list[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("megatron.training") is None:
        from megatron.core import package_info

        raise SystemExit(
            f"megatron-core {package_info.__version__} ships no megatron/training (0.17 and later do); "
            f"give a Megatron-LM checkout's pretrain_gpt.py first\n{USAGE}")
    from megatron_patches.testing import gpt_loop, megatron_lm_cpu, step_probe

    import torch

    megatron_lm_cpu.install(on_cpu=not torch.cuda.is_available())
    if os.environ.get(step_probe.ENV):
        step_probe.install(os.environ[step_probe.ENV])
    if WITHOUT_GUARD in args:
        args = [a for a in args if a != WITHOUT_GUARD]
    else:
        import megatron_patches.apply  # noqa: F401  (the user's opt-in line)

    sys.argv = [sys.argv[0], *args]
    gpt_loop.run()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]) and len(argv) == 1:
        raise SystemExit(USAGE)
    try:
        if argv and not argv[0].startswith("-"):
            script = Path(argv[0]).resolve()
            if not script.is_file():
                raise SystemExit(f"training script not found: {argv[0]}\n{USAGE}")
            _run_script(script, argv[1:])
        else:
            _run_packaged(argv)
    except ModuleNotFoundError as exc:
        raise SystemExit(_missing_module(exc)) from None


if __name__ == "__main__":
    from megatron_patches.testing.process_end import run_then_end

    run_then_end(main)
