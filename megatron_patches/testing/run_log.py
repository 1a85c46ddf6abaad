"""What the tiny-GPT harness reports about a run: a line per step, TensorBoard scalars, and
``<out>/result.json`` at the end (the fields the tests and docs read)."""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any, Optional

from ..errors import UserError


class RunLog:
    """Losses, skipped and executed steps, and how far the guard's gradient norm strayed from
    Megatron's, collected step by step on every rank; printed and written on rank 0."""

    def __init__(self, args: argparse.Namespace, monitor: Any, rank: int):
        self.args, self.monitor, self.rank = args, monitor, rank
        self.losses: dict[int, float] = {}
        self.loss_log: list = []
        self.norm_gap = {"max_rel_diff": 0.0, "steps": 0}
        self.skipped = self.executed = 0
        self.started = time.time()
        self.tensorboard = open_tensorboard(args.tensorboard_dir) if rank == 0 else None

    def step(self, step: int, out: dict, lr: float, checked: bool, seconds: float) -> None:
        """Note one optimizer step's outcome; ``checked``: the guard checked this step."""
        self.executed += 1
        self.skipped += out["skipped"]
        if checked:
            self._compare_norms(out)
        self.losses[step] = out["loss"]
        self.loss_log.append([step, out["loss"] if math.isfinite(out["loss"]) else None])
        if self.rank != 0:
            return
        norm = out["grad_norm"]
        incidents = self.monitor.state.counters["incidents"] if self.monitor else 0
        print(f"step {step:>4}/{self.args.steps} | loss {out['loss']:.4f} | grad-norm "
              f"{'-' if norm is None else f'{norm:.3g}'} | lr {lr:.2e} | "
              f"skipped {self.skipped} | incidents {incidents} | {seconds * 1000:.0f} ms", flush=True)
        if self.tensorboard is not None:
            self._log_metrics(step, out, lr)

    def rewind(self, step: int) -> None:
        """A rollback: training continues at ``step``; the losses from there on are run again."""
        self.losses = {k: v for k, v in self.losses.items() if k < step}

    def _compare_norms(self, out: dict) -> None:
        """Keep the largest relative gap between the guard's total gradient norm and the one
        Megatron's optimizer reported for the same step (steps both of them measured)."""
        ours, theirs = (self.monitor.state.last_total_norm if self.monitor else None), out["grad_norm"]
        if ours is None or theirs is None or out["skipped"]:
            return
        gap = abs(ours - theirs) / max(abs(theirs), 1e-30)
        self.norm_gap = {"max_rel_diff": max(gap, self.norm_gap["max_rel_diff"]),
                         "steps": self.norm_gap["steps"] + 1}

    def _log_metrics(self, step: int, out: dict, lr: float) -> None:
        """Per-step live metrics: loss and lr, and the guard's counters and gradient norms."""
        tb = self.tensorboard
        tb.add_scalar("train/loss", out["loss"], step)
        tb.add_scalar("train/lr", lr, step)
        if self.monitor is None:
            return
        for name, value in self.monitor.state.counters.items():
            tb.add_scalar(f"megatron_patches/{name}", value, step)
        if self.monitor.state.last_total_norm is not None:
            tb.add_scalar("megatron_patches/total_grad_norm", self.monitor.state.last_total_norm, step)
        for layer, norm in self.monitor.state.last_layer_norms.items():
            tb.add_scalar(f"megatron_patches/layer_grad_norm/{layer}", norm, step)

    def result(self, params_finite: bool, ledger: Any, lr_scale: float, **layout: Any) -> dict[str, Any]:
        """The run's result.json fields; ``layout``: world_size, tp, pp, dp, precision, distributed
        optimizer and device, in that order."""
        losses = [self.losses[k] for k in sorted(self.losses)]
        finite_losses = [x for x in losses if math.isfinite(x)]
        return {
            "steps_completed": len(losses),
            "initial_loss": losses[0] if losses else None,
            "final_loss": sum(finite_losses[-3:]) / len(finite_losses[-3:]) if finite_losses else None,
            "losses": [x if math.isfinite(x) else None for x in losses],
            "skipped_steps": self.skipped,
            "params_finite": params_finite,
            "executed_steps": self.executed,
            "loss_log": self.loss_log,
            "grad_norm_vs_megatron": self.norm_gap,
            "rollbacks": ledger.rollbacks if ledger else 0,
            "blacklisted_samples": list(ledger.blacklist) if ledger else [],
            "lr_scale": lr_scale,
            "incidents": self.monitor.state.counters["incidents"] if self.monitor else 0,
            "monitor": dict(self.monitor.state.counters) if self.monitor else None,
            **layout,
            "seconds": round(time.time() - self.started, 3),
            "lost_writes": {},
        }

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Close the guard (its lost writes go into ``result``) and TensorBoard; rank 0 writes
        ``<out>/result.json`` and prints the closing line."""
        if self.monitor is not None:
            scenes = self.monitor.state.publisher.scenes  # close() lets go of it; its failures are counted while closing
            self.monitor.close()
            result["lost_writes"] = lost_writes(self.monitor, scenes)
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.rank == 0:
            from ..files import write_json_atomic

            os.makedirs(self.args.out, exist_ok=True)
            path = os.path.join(self.args.out, "result.json")
            write_json_atomic(path, result, indent=2)
            print(f"done: {result['steps_completed']} steps, loss {result['initial_loss']:.4f} -> "
                  f"{result['final_loss']:.4f}, skipped {self.skipped}, incidents {result['incidents']}, "
                  f"params finite: {result['params_finite']} -> {path}", flush=True)
        return result


def open_tensorboard(directory: Optional[str]):
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("--tensorboard-dir needs the tensorboard package: pip install 'megatron_patches[tensorboard]'")
    return SummaryWriter(directory)


def lost_writes(monitor: Any, scenes: Any) -> dict[str, int]:
    """Records the guard could not write on this rank (its report files and fault scenes),
    by file; each loss was logged as a warning and training went on."""
    lost = {}
    for writer in monitor.state.publisher.writers():
        if writer.lost_writes:
            lost[writer.path] = writer.lost_writes
    if scenes is not None and scenes.failed:
        lost[os.path.join(monitor.state.report_dir, "scenes")] = scenes.failed
    return lost
