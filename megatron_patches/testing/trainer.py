"""The tiny-GPT training loop behind ``python -m megatron_patches.tiny_gpt``.

Reads top to bottom: parallel groups, data, model, DDP, optimizer (:mod:`.build`), then a loop
of forward-backward (megatron-core's schedule) and ``optimizer.step()``; :mod:`.run_log` prints
and records what happened. The guard comes in already installed (``runtime.install``, as
``import megatron_patches.apply`` does in a Megatron-LM job) and is handed over as ``monitor``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from typing import Any, Optional

import torch

from .. import safe_mode
from ..collectives import all_gather_floats
from ..detectors.loss import feed_loss
from ..errors import UserError
from .build import build_corpus, build_model, build_optimizer
from .data import Sampler
from .run_log import RunLog

log = logging.getLogger("megatron_patches")


def _parallel_groups(ps: Any, args: argparse.Namespace) -> None:
    """megatron-core's parallel groups for ``--tp``/``--pp``, made once per process: a branch
    server's trainings (testing/branch_server.py) share the first one's."""
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(args.tp, args.pp)
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (args.tp, args.pp):
        raise UserError(f"--tp {args.tp} --pp {args.pp} differ from this process's parallel groups "
                        f"(a branch server serves one layout); start a server for this layout")


class TinyTrainer:
    """A tiny GPT on megatron-core, trained step by step; also the loop that
    :class:`~megatron_patches.recovery.InProcessRecovery` replays and rolls back."""

    def __init__(self, args: argparse.Namespace, device: str, monitor: Any = None):
        """``monitor``: the installed guard (``runtime.install``), or None to train unguarded."""
        self.args = args
        self.device = device
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._collective = torch.device("cpu") if device == "cpu" else torch.device(device, local_rank)
        self.monitor = monitor

        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        _parallel_groups(ps, args)
        model_parallel_cuda_manual_seed(args.seed)
        torch.manual_seed(args.seed)
        self.ps = ps
        self.rank = torch.distributed.get_rank()
        self.dp = ps.get_data_parallel_world_size()
        self.corpus = build_corpus(args, self.rank)  # first: a bad --data path fails before any model is built
        self.model, self.config = build_model(args, device)
        global_batch = args.micro_batch_size * args.micro_batches * self.dp
        self.optimizer, self.scheduler = build_optimizer(args, self.model, self.config, global_batch)
        self.sampler = Sampler(global_batch)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_backward = get_forward_backward_func()
        self.checkpoint_root = os.path.join(args.out, "checkpoints")
        self._base_lr = (self.scheduler.init_lr, self.scheduler.max_lr, self.scheduler.min_lr,
                         [(g.get("max_lr"), g.get("min_lr")) for g in self.optimizer.param_groups])
        self.lr_scale = 1.0
        self._step_inputs: Optional[tuple] = None
        self.recovery = None
        self._ledger_lr_scale = 1.0
        self.run_log = RunLog(args, self.monitor, self.rank)
        self.certification = None
        if self.monitor is not None:  # its checkpoints are targets once the checks after them came out clean
            from ..checkpoint import Certification

            self.certification = Certification(self.monitor.state.config.recovery.certify_steps, self.rank)
            self.monitor.add_callback(self.certification)
        if self.monitor is not None and args.recovery == "in-process":
            from ..recovery import InProcessRecovery

            self.recovery = InProcessRecovery(self.monitor, self)
        elif self.monitor is not None:
            from ..ledger import Ledger
            from ..recovery import ExitAndRestart

            ExitAndRestart(self.monitor, self.checkpoint_root)
            ledger = Ledger.load(self.checkpoint_root)
            self.set_blacklist(ledger.blacklist)
            self._ledger_lr_scale = ledger.lr_scale

    # --- one step ------------------------------------------------------------------------

    def _my_microbatches(self, global_indices: list[int]) -> list[list[int]]:
        a = self.args
        per_rank = a.micro_batch_size * a.micro_batches
        mine = global_indices[self.ps.get_data_parallel_rank() * per_rank:][:per_rank]
        return [mine[i * a.micro_batch_size:(i + 1) * a.micro_batch_size] for i in range(a.micro_batches)]

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.device)
        labels = batch["labels"].to(self.device)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(tokens, positions, None, labels=labels)
        poisoned = self.monitor.state.drills.poisoned(batch["samples"]) if self.monitor is not None else ()
        rows = [row for row, index in enumerate(batch["samples"]) if index in poisoned]

        def loss_func(per_token_loss):
            if rows:  # a poisoned sample: its loss, and so every gradient, is NaN each time it is fed
                # Multiplied, not overwritten: the NaN must flow into the backward pass too.
                mask = torch.ones_like(per_token_loss)
                mask[rows] = float("nan")
                per_token_loss = per_token_loss * mask
            loss = per_token_loss.float().mean()
            # The schedule divides the returned loss in place; report an independent copy.
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; returns {loss, grad_norm, skipped, samples} (same on every rank)."""
        global_batch = self.sampler.next_global_batch()
        microbatches = self._my_microbatches(global_batch)
        from ..seams.rng import rng_state

        self._step_inputs = (step, microbatches, rng_state())
        self._checked_before_step = self.monitor.state.counters["checked_steps"] if self.monitor else 0
        out = self._forward_backward(step, microbatches)
        if step in self.args.branch_skip:  # a branch's twin of a run whose guard skipped this step
            success, grad_norm = False, None
        else:
            success, grad_norm, _ = self.optimizer.step()
        if grad_norm is not None:
            grad_norm = float(grad_norm)  # 0.19+ may hand back a one-element tensor
        if success:
            self.scheduler.step(increment=len(global_batch))
        return {"loss": out["loss"], "grad_norm": grad_norm, "skipped": not success, "samples": global_batch}

    def _forward_backward(self, step: int, microbatches: list[list[int]]) -> dict[str, Any]:
        a = self.args
        batches = [{**self.corpus.batch(mb), "samples": mb} for mb in microbatches]
        if self.monitor is not None:
            self.monitor.set_step(step)
            self.monitor.set_batch([i for mb in microbatches for i in mb], tokens=[b["tokens"] for b in batches])
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iter(batches), model=[self.model],
            num_microbatches=a.micro_batches, seq_length=a.seq, micro_batch_size=a.micro_batch_size,
            forward_only=False)
        bad = [i for mb, d in zip(microbatches, losses) for i in mb if not math.isfinite(float(d["lm loss"]))]
        loss, own = self._mean_loss(losses)
        if self.monitor is not None:  # judged at this step's check, before the update (detectors.loss_spike)
            feed_loss(self.monitor.state.detectors, loss, local=own)
        return {"loss": loss, "bad_samples": bad}

    # --- what InProcessRecovery needs (megatron_patches.recovery.TrainingLoop) -----------

    def replay_step(self, step: int) -> dict:
        from ..seams.rng import set_rng_state

        saved_step, microbatches, rng = self._step_inputs
        assert saved_step == step, f"replay of step {step} but the last step run was {saved_step}"
        set_rng_state(rng)
        out = self._forward_backward(step, microbatches)
        verdict = self.monitor.replay_check(self.optimizer, step)
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, out["bad_samples"])
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return {**verdict, "bad_samples": sorted({i for part in every for i in part})}

    def load_checkpoint(self, path: str) -> int:
        from . import branch
        from .checkpoints import load_checkpoint

        if branch.holds(path):  # a branch's rollback target: the snapshot it started from
            return branch.load(self, path)
        common = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.sampler.load_state_dict(common["sampler"])
        if self.monitor is not None and common.get("monitor"):
            # Baselines (gradient-norm history) survive the restore, so the first step after it
            # is judged against what was normal, not a fresh warm-up.
            self.monitor.load_state_dict(common["monitor"])
        return int(common["step"])

    def live_tensors(self) -> list:
        """Model parameters, main weights and optimizer state: what an in-memory snapshot copies (the
        same function as Megatron-LM's in-process rollback)."""
        from ..seams.megatron_lm.state import live_tensors

        return live_tensors([self.model], self.optimizer)

    def state_values(self) -> dict:
        """Scheduler, param groups, loss scaler, RNG, rerun machine, guard baselines (Megatron-LM's
        loop snapshots the same) and the harness's data position."""
        from ..seams.megatron_lm.state import small_values

        return {**small_values(self.optimizer, self.scheduler, self.monitor, self.lr_scale),
                "sampler": self.sampler.state_dict()}

    def restore_values(self, values: dict) -> None:
        from ..seams.megatron_lm.state import after_restore, restore_values

        after_restore([self.model], self.optimizer)
        restore_values(values, self.optimizer, self.scheduler, self.monitor)
        self.sampler.load_state_dict(values["sampler"])
        self.lr_scale = values["lr_scale"]

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale
        init, top, bottom, groups = self._base_lr
        self.scheduler.init_lr, self.scheduler.max_lr, self.scheduler.min_lr = init * scale, top * scale, bottom * scale
        # megatron-core's scheduler reads per-group max_lr/min_lr where the groups carry them.
        for group, (group_max, group_min) in zip(self.optimizer.param_groups, groups):
            if group_max is not None:
                group["max_lr"] = group_max * scale
            if group_min is not None:
                group["min_lr"] = group_min * scale
        self.scheduler.step(increment=0)

    def set_blacklist(self, samples: list) -> None:
        self.sampler.blacklist = set(samples)

    def disable_feature(self, name: str) -> None:
        if name != "dropout":  # the harness's model has no fusions and no overlap to switch off
            log.info("safe mode: %s is not used by the harness (already off)", name)
            return
        self.config.hidden_dropout = self.config.attention_dropout = 0.0
        safe_mode.dropout_off(self.model.modules())

    def save(self, step: int, healthy: bool) -> None:
        from .checkpoints import save_checkpoint

        extra = {"sampler": self.sampler.state_dict(),
                 "monitor": self.monitor.state_dict() if self.monitor is not None else None}
        keep = (self.monitor.state.config.recovery.keep_checkpoints if self.monitor is not None else None) or 3
        path = save_checkpoint(self.checkpoint_root, step, self.model, self.optimizer, self.scheduler, extra,
                               healthy=healthy, keep=keep, awaiting=self.certification is not None)
        if healthy and self.certification is not None:
            self.certification.awaiting(step, path)
        if self.monitor is not None:  # the check that certifies it reads all of the held state
            from ..detectors import target_taken

            target_taken(self.monitor.state.detectors)

    def _mean_loss(self, losses: list[dict]) -> tuple[float, Optional[float]]:
        """Mean loss over the last pipeline stage's ranks, known on every rank (float32 tensors on
        the wire: :func:`~.collectives.all_gather_floats`; summed in rank order, the same everywhere),
        and this rank's own mean (None on a stage without a loss)."""
        mean = sum(float(d["lm loss"]) for d in losses) / len(losses) if losses else 0.0
        every = all_gather_floats([mean, 1.0 if losses else 0.0], self._collective)
        loss_sum = sum(m for m, _ in every)
        count = sum(c for _, c in every)
        return (loss_sum / count if count > 0 else float("nan")), (mean if losses else None)

    # --- loop ----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        a, log = self.args, self.run_log
        log.started = time.time()
        incidents_at_last_save = 0
        step = 1
        probe = None
        if a.branch_from or a.branch_dump or a.branch_snapshot_at:
            from . import branch

            probe = branch.Probe() if a.branch_dump else None
        if a.branch_from:
            step = branch.load(self, a.branch_from) + 1
            if a.branch_nudge:
                branch.nudge(self, a.branch_nudge)
            if a.branch_blacklist:
                self.set_blacklist(sorted(a.branch_blacklist))
        elif a.resume:
            step = self._resume()
        elif a.save_interval and not a.distributed_optimizer and not a.save_from:
            # The distributed optimizer's state_dict asserts one Adam step count, and torch Adam has
            # none before its first update: with it the first checkpoint is the first interval's.
            self.save(0, healthy=self._params_finite())
        while step <= a.steps:
            t0 = time.perf_counter()
            out = self.train_step(step)
            checked = self.monitor is not None and self.monitor.state.counters["checked_steps"] != self._checked_before_step
            # check_interval > 1: on an unchecked step last_total_norm belongs to an earlier step
            log.step(step, out, self.optimizer.param_groups[0]["lr"], checked, time.perf_counter() - t0)
            if probe is not None:
                probe.after_step(self, step, out["skipped"])
            resume = self.recovery.after_step(step, out["samples"]) if self.recovery else None
            if resume is not None:
                log.rewind(resume)
                incidents_at_last_save = self.monitor.state.counters["incidents"]
                step = resume
                continue
            if a.save_interval and step >= a.save_from and (step - a.save_from) % a.save_interval == 0:
                incidents = self.monitor.state.counters["incidents"] if self.monitor else 0
                self.save(step, healthy=incidents == incidents_at_last_save and self._params_finite())
                incidents_at_last_save = incidents
            if step == a.branch_snapshot_at:
                branch.save(self, step)
            step += 1
        if probe is not None:
            probe.dump(self, a.out)
        return self._finish()

    def _resume(self) -> int:
        """--resume: load the newest healthy checkpoint (one the last job saved and could not
        certify is certified by this job's first clean checks); returns the step to run next."""
        from ..checkpoint import newest_resumable

        found = newest_resumable(self.checkpoint_root)
        if found is None:
            raise UserError(f"--resume: no healthy checkpoint under {self.checkpoint_root}")
        step = self.load_checkpoint(found[1]) + 1
        if found[2] and self.certification is not None:
            self.certification.awaiting(found[0], found[1])
        # the ledger's lr scale applies on top of the restored schedule
        self.set_lr_scale(self.recovery.ledger.lr_scale if self.recovery else self._ledger_lr_scale)
        if self.rank == 0:
            print(f"resumed from {found[1]} at step {step}", flush=True)
        return step

    def _params_finite(self) -> bool:
        from ..checkpoint import params_finite

        return params_finite(self.model)

    def _finish(self) -> dict[str, Any]:
        a = self.args
        result = self.run_log.result(
            self._params_finite(), self.recovery.ledger if self.recovery else None, self.lr_scale,
            world_size=torch.distributed.get_world_size(), tp=a.tp, pp=a.pp, dp=self.dp,
            precision=a.precision, distributed_optimizer=a.distributed_optimizer, device=self.device)
        return self.run_log.finish(result)
