"""The tiny-GPT harness with Megatron's norm computation watched: ``python tests/norm_audit.py
--out DIR [harness args]`` (under torchrun too) trains as ``python -m megatron_patches.tiny_gpt``
does and writes ``DIR/norm_audit.rank<R>.json``; with ``--run-module M`` first, module ``M`` runs
instead with the remaining arguments (``megatron_patches.testing.pretrain_cpu``: Megatron-LM's loop):

- ``stock_calls``: the step of each call of megatron-core's ``get_grad_norm_fp32`` made by
  Megatron's own optimizer code (the function that reads the gradients for the norm);
- ``served``: ``[step, norm the guard handed Megatron, norm Megatron's own code gives for the
  same gradients]`` for each norm the guard served. The second value is computed here, at that
  moment, by the unwrapped ``get_grad_norm`` (its calls are not counted as Megatron's).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import megatron.core.optimizer.optimizer as megatron_optimizer

from megatron_patches.seams import wrappers, served_norm

stock_calls: list = []
served: list = []
_auditing = False
_get_grad_norm_fp32 = megatron_optimizer.get_grad_norm_fp32
_take = served_norm.take


def _step() -> int:
    monitor = wrappers.get_monitor()
    return monitor.step if monitor is not None else -1


def counted_get_grad_norm_fp32(*args, **kwargs):
    if not _auditing:
        stock_calls.append(_step())
    return _get_grad_norm_fp32(*args, **kwargs)


def audited_take(monitor, optimizer):
    global _auditing
    norm = _take(monitor, optimizer)
    if norm is None or _auditing:
        return norm
    owner = next(c for c in type(optimizer).__mro__ if "get_grad_norm" in c.__dict__)
    stock_get_grad_norm = owner.__dict__["get_grad_norm"].__wrapped__  # under our wrapper
    _auditing = True
    try:
        stock = stock_get_grad_norm(optimizer)
    finally:
        _auditing = False
    served.append([_step(), float(norm), float(stock)])
    return norm


def main() -> int:
    args = sys.argv[1:]
    out = args[args.index("--out") + 1]
    module = "megatron_patches.tiny_gpt"
    if args[:1] == ["--run-module"]:  # another runner, which takes no --out
        module, args = args[1], args[2:]
        at = args.index("--out")
        del args[at:at + 2]
    megatron_optimizer.get_grad_norm_fp32 = counted_get_grad_norm_fp32
    served_norm.take = audited_take
    sys.argv = [module, *args]
    try:
        return importlib.import_module(module).main()  # both runners read sys.argv
    finally:
        rank = os.environ.get("RANK", "0")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"norm_audit.rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump({"stock_calls": stock_calls, "served": served}, f)


if __name__ == "__main__":
    from megatron_patches.testing.process_end import run_then_end

    run_then_end(main)
