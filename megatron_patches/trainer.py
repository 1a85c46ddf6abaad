"""The tiny-GPT training loop behind ``python -m megatron_patches.tiny_gpt``.

Reads top to bottom: guard, parallel groups, model, DDP, optimizer, then a loop of
forward-backward (megatron-core's schedule) and ``optimizer.step()``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import time
from typing import Any, Optional

import torch

from .collectives import all_gather_floats
from .data import Sampler, TextCorpus, TinyCorpus
from .errors import UserError


class TinyTrainer:
    def __init__(self, args: argparse.Namespace, device: str):
        self.args = args
        self.device = device
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._collective = torch.device("cpu") if device == "cpu" else torch.device(device, local_rank)
        # The same opt-in a Megatron-LM user adds to pretrain_gpt.py (reads MEGATRON_PATCHES_CONFIG).
        self.monitor = None if args.no_guard else importlib.import_module("megatron_patches.apply").monitor

        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        ps.initialize_model_parallel(args.tp, args.pp)
        model_parallel_cuda_manual_seed(args.seed)
        torch.manual_seed(args.seed)
        self.ps = ps
        self.rank = torch.distributed.get_rank()
        self.dp = ps.get_data_parallel_world_size()
        self.corpus = self._build_corpus()  # first: a bad --data path fails before any model is built
        self.model, self.config = self._build_model()
        self.optimizer, self.scheduler = self._build_optimizer()
        self.sampler = Sampler(args.micro_batch_size * args.micro_batches * self.dp)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_backward = get_forward_backward_func()
        self.checkpoint_root = os.path.join(args.out, "checkpoints")
        self._base_lr = (self.scheduler.init_lr, self.scheduler.max_lr, self.scheduler.min_lr,
                         [(g.get("max_lr"), g.get("min_lr")) for g in self.optimizer.param_groups])
        self.lr_scale = 1.0
        self._step_inputs: Optional[tuple] = None
        self.recovery = None
        self._ledger_lr_scale = 1.0
        self.tensorboard = self._open_tensorboard(args.tensorboard_dir) if self.rank == 0 else None
        if self.monitor is not None and args.recovery == "in-process":
            from .recovery import InProcessRecovery

            self.recovery = InProcessRecovery(self.monitor, self)
        elif self.monitor is not None:
            from .recovery import ExitAndRestart, Ledger

            ExitAndRestart(self.monitor, self.checkpoint_root)
            ledger = Ledger.load(self.checkpoint_root)
            self.set_blacklist(ledger.blacklist)
            self._ledger_lr_scale = ledger.lr_scale

    # --- build ---------------------------------------------------------------------------

    def _build_model(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig

        a, ps = self.args, self.ps
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
        config = TransformerConfig(
            num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
            tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=a.precision == "bf16", fp16=a.precision == "fp16",
            use_cpu_initialization=True, hidden_dropout=a.dropout, attention_dropout=a.dropout,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        )
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=a.vocab,
            max_sequence_length=a.seq, pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
        if self.device != "cpu":
            model = model.to(self.device)
        if a.precision != "fp32":
            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=a.distributed_optimizer,
            check_for_nan_in_grad=a.check_for_nan_in_grad)
        model = DistributedDataParallel(config, ddp_config, model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        return model, config

    def _build_corpus(self):
        a = self.args
        if not a.data.startswith("text:"):
            return TinyCorpus(a.vocab, a.seq, seed=a.seed)
        corpus = TextCorpus(a.data[len("text:"):], a.seq, seed=a.seed, max_bytes=int(a.data_max_mib * 2**20))
        if self.rank == 0:
            print(corpus.describe(), flush=True)
        return corpus

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a = self.args
        opt_config = OptimizerConfig(
            optimizer="adam", lr=a.lr, min_lr=a.lr, weight_decay=0.01, clip_grad=1.0,
            bf16=a.precision == "bf16", fp16=a.precision == "fp16",
            initial_loss_scale=2.0 ** 16 if a.precision == "fp16" else None,
            use_distributed_optimizer=a.distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.config.grad_scale_func = optimizer.scale_loss
        global_batch = a.micro_batch_size * a.micro_batches * self.dp
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=a.lr, max_lr=a.lr, min_lr=a.lr, lr_warmup_steps=0,
            lr_decay_steps=a.steps * global_batch, lr_decay_style="constant",
            start_wd=0.01, end_wd=0.01, wd_incr_steps=a.steps * global_batch, wd_incr_style="constant")
        return optimizer, scheduler

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
        poisoned = self.monitor.injector.poisoned(batch["samples"]) if self.monitor is not None else ()
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
        from .checkpoint import rng_state

        self._step_inputs = (step, microbatches, rng_state())
        self._checked_before_step = self.monitor.counters["checked_steps"] if self.monitor else 0
        out = self._forward_backward(step, microbatches)
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
        return {"loss": self._mean_loss(losses), "bad_samples": bad}

    # --- what InProcessRecovery needs (megatron_patches.recovery.TrainingLoop) -----------

    def replay_step(self, step: int) -> dict:
        from .checkpoint import set_rng_state

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
        from .checkpoint import load_checkpoint

        common = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.sampler.load_state_dict(common["sampler"])
        if self.monitor is not None and common.get("monitor"):
            # Baselines (gradient-norm history) survive the restore, so the first step after it
            # is judged against what was normal, not a fresh warm-up.
            self.monitor.load_state_dict(common["monitor"])
        return int(common["step"])

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
        if name != "dropout":
            raise ValueError(f"tiny_gpt can disable only 'dropout', got {name!r}")
        self.config.hidden_dropout = self.config.attention_dropout = 0.0
        for module in self.model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "hidden_dropout", None), float):
                module.hidden_dropout = 0.0

    def save(self, step: int, healthy: bool) -> None:
        from .checkpoint import save_checkpoint

        extra = {"sampler": self.sampler.state_dict(),
                 "monitor": self.monitor.state_dict() if self.monitor is not None else None}
        keep = self.monitor.config.recovery.keep_checkpoints if self.monitor is not None else 3
        save_checkpoint(self.checkpoint_root, step, self.model, self.optimizer, self.scheduler, extra,
                        healthy=healthy, keep=keep)

    def _mean_loss(self, losses: list[dict]) -> float:
        """Mean loss over the last pipeline stage's ranks, known on every rank (float32 tensors on
        the wire: :func:`~.collectives.all_gather_floats`; summed in rank order, the same everywhere)."""
        mean = sum(float(d["lm loss"]) for d in losses) / len(losses) if losses else 0.0
        every = all_gather_floats([mean, 1.0 if losses else 0.0], self._collective)
        loss_sum = sum(m for m, _ in every)
        count = sum(c for _, c in every)
        return loss_sum / count if count > 0 else float("nan")

    # --- loop ----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        a = self.args
        losses: dict[int, float] = {}
        self.loss_log: list = []
        self.norm_gap = {"max_rel_diff": 0.0, "steps": 0}
        skipped = executed = 0
        started = time.time()
        incidents_at_last_save = 0
        step = 1
        if a.resume:
            from .checkpoint import newest_healthy

            found = newest_healthy(self.checkpoint_root)
            if found is None:
                raise UserError(f"--resume: no healthy checkpoint under {self.checkpoint_root}")
            step = self.load_checkpoint(found[1]) + 1
            # the ledger's lr scale applies on top of the restored schedule
            self.set_lr_scale(self.recovery.ledger.lr_scale if self.recovery else self._ledger_lr_scale)
            if self.rank == 0:
                print(f"resumed from {found[1]} at step {step}", flush=True)
        elif a.save_interval:
            self.save(0, healthy=self._params_finite())
        while step <= a.steps:
            t0 = time.perf_counter()
            out = self.train_step(step)
            executed += 1
            skipped += out["skipped"]
            self._compare_norms(out)
            losses[step] = out["loss"]
            self.loss_log.append([step, out["loss"] if math.isfinite(out["loss"]) else None])
            if self.rank == 0:
                self._print_progress(step, out, skipped, time.perf_counter() - t0)
                if self.tensorboard is not None:
                    self._log_metrics(step, out)
            resume = self.recovery.after_step(step, out["samples"]) if self.recovery else None
            if resume is not None:
                losses = {k: v for k, v in losses.items() if k < resume}
                incidents_at_last_save = self.monitor.counters["incidents"]
                step = resume
                continue
            if a.save_interval and step % a.save_interval == 0:
                incidents = self.monitor.counters["incidents"] if self.monitor else 0
                self.save(step, healthy=incidents == incidents_at_last_save and self._params_finite())
                incidents_at_last_save = incidents
            step += 1
        ordered = [losses[k] for k in sorted(losses)]
        return self._finish(ordered, skipped, executed, time.time() - started)

    def _compare_norms(self, out: dict) -> None:
        """Keep the largest relative gap between the guard's total gradient norm and the one
        Megatron's optimizer reported for the same step (steps both of them measured)."""
        ours, theirs = (self.monitor.last_total_norm if self.monitor else None), out["grad_norm"]
        if self.monitor is None or ours is None or theirs is None or out["skipped"]:
            return
        if self.monitor.counters["checked_steps"] == self._checked_before_step:
            return  # check_interval > 1: last_total_norm belongs to an earlier step
        gap = abs(ours - theirs) / max(abs(theirs), 1e-30)
        self.norm_gap = {"max_rel_diff": max(gap, self.norm_gap["max_rel_diff"]),
                         "steps": self.norm_gap["steps"] + 1}

    def _open_tensorboard(self, directory: Optional[str]):
        if not directory:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard-dir needs the tensorboard package: pip install 'megatron_patches[tensorboard]'")
        return SummaryWriter(directory)

    def _log_metrics(self, step: int, out: dict) -> None:
        """Per-step live metrics: loss and lr, and the guard's counters and gradient norms."""
        tb = self.tensorboard
        tb.add_scalar("train/loss", out["loss"], step)
        tb.add_scalar("train/lr", self.optimizer.param_groups[0]["lr"], step)
        if self.monitor is None:
            return
        for name, value in self.monitor.counters.items():
            tb.add_scalar(f"megatron_patches/{name}", value, step)
        if self.monitor.last_total_norm is not None:
            tb.add_scalar("megatron_patches/total_grad_norm", self.monitor.last_total_norm, step)
        for layer, norm in self.monitor.last_layer_norms.items():
            tb.add_scalar(f"megatron_patches/layer_grad_norm/{layer}", norm, step)

    def _lost_writes(self, scenes: Any) -> dict[str, int]:
        """Records the guard could not write on this rank (its report files and fault scenes),
        by file; each loss was logged as a warning and training went on."""
        lost = {}
        for writer in self.monitor.publisher.writers():
            if writer.lost_writes:
                lost[writer.path] = writer.lost_writes
        if scenes is not None and scenes.failed:
            lost[os.path.join(self.monitor.report_dir, "scenes")] = scenes.failed
        return lost

    def _params_finite(self) -> bool:
        from .checkpoint import params_finite

        return params_finite(self.model)

    def _print_progress(self, step: int, out: dict, skipped: int, seconds: float) -> None:
        norm = out["grad_norm"]
        incidents = self.monitor.counters["incidents"] if self.monitor else 0
        print(f"step {step:>4}/{self.args.steps} | loss {out['loss']:.4f} | grad-norm "
              f"{'-' if norm is None else f'{norm:.3g}'} | lr {self.optimizer.param_groups[0]['lr']:.2e} | "
              f"skipped {skipped} | incidents {incidents} | {seconds * 1000:.0f} ms", flush=True)

    def _finish(self, losses: list[float], skipped: int, executed: int, seconds: float) -> dict[str, Any]:
        a = self.args
        params_finite = self._params_finite()
        ledger = self.recovery.ledger if self.recovery else None
        finite_losses = [x for x in losses if math.isfinite(x)]
        result = {
            "steps_completed": len(losses),
            "initial_loss": losses[0] if losses else None,
            "final_loss": sum(finite_losses[-3:]) / len(finite_losses[-3:]) if finite_losses else None,
            "losses": [x if math.isfinite(x) else None for x in losses],
            "skipped_steps": skipped,
            "params_finite": params_finite,
            "executed_steps": executed,
            "loss_log": self.loss_log,
            "grad_norm_vs_megatron": self.norm_gap,
            "rollbacks": ledger.rollbacks if ledger else 0,
            "blacklisted_samples": list(ledger.blacklist) if ledger else [],
            "lr_scale": self.lr_scale,
            "incidents": self.monitor.counters["incidents"] if self.monitor else 0,
            "monitor": dict(self.monitor.counters) if self.monitor else None,
            "world_size": torch.distributed.get_world_size(),
            "tp": a.tp, "pp": a.pp, "dp": self.dp,
            "precision": a.precision, "distributed_optimizer": a.distributed_optimizer,
            "device": self.device, "seconds": round(seconds, 3),
            "lost_writes": {},
        }
        if self.monitor is not None:
            scenes = self.monitor.publisher.scenes  # close() lets go of it; its failures are counted while closing
            self.monitor.close()
            result["lost_writes"] = self._lost_writes(scenes)
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.rank == 0:
            from .checkpoint import write_json_atomic

            os.makedirs(a.out, exist_ok=True)
            path = os.path.join(a.out, "result.json")
            write_json_atomic(path, result, indent=2)
            print(f"done: {len(losses)} steps, loss {result['initial_loss']:.4f} -> {result['final_loss']:.4f}, "
                  f"skipped {skipped}, incidents {result['incidents']}, params finite: {result['params_finite']} "
                  f"-> {path}", flush=True)
        return result

