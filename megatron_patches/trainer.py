"""The tiny-GPT training loop behind ``python -m megatron_patches.tiny_gpt``.

Reads top to bottom: guard, parallel groups, model, DDP, optimizer, then a loop of
forward-backward (megatron-core's schedule) and ``optimizer.step()``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time
from typing import Any, Optional

import torch

from .data import Sampler, TinyCorpus


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
        self.model, self.config = self._build_model()
        self.optimizer, self.scheduler = self._build_optimizer()
        self.corpus = TinyCorpus(args.vocab, args.seq, seed=args.seed)
        self.sampler = Sampler(args.micro_batch_size * args.micro_batches * self.dp)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_backward = get_forward_backward_func()

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
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
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
            grad_reduce_in_fp32=True, use_distributed_optimizer=a.distributed_optimizer)
        model = DistributedDataParallel(config, ddp_config, model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        return model, config

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

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            # The schedule divides the returned loss in place; report an independent copy.
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; returns {loss, grad_norm, skipped} (loss on every rank)."""
        a = self.args
        microbatches = self._my_microbatches(self.sampler.next_global_batch())
        if self.monitor is not None:
            self.monitor.set_step(step)
            self.monitor.set_batch([i for mb in microbatches for i in mb])
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=iter([self.corpus.batch(mb) for mb in microbatches]),
            model=[self.model], num_microbatches=a.micro_batches, seq_length=a.seq,
            micro_batch_size=a.micro_batch_size, forward_only=False)
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=a.micro_batch_size * a.micro_batches * self.dp)
        return {"loss": self._mean_loss(losses), "grad_norm": grad_norm, "skipped": not success}

    def _mean_loss(self, losses: list[dict]) -> float:
        """Mean loss over the last pipeline stage's ranks, known on every rank."""
        mean = sum(float(d["lm loss"]) for d in losses) / len(losses) if losses else 0.0
        total = torch.tensor([mean, 1.0 if losses else 0.0], dtype=torch.float64, device=self._collective)
        torch.distributed.all_reduce(total)
        loss_sum, count = total.tolist()
        return loss_sum / count if count > 0 else float("nan")

    # --- loop ----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        a = self.args
        losses, skipped, started = [], 0, time.time()
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            out = self.train_step(step)
            skipped += out["skipped"]
            losses.append(out["loss"])
            if a.save_interval and step % a.save_interval == 0:
                from .checkpoint import save_checkpoint

                save_checkpoint(os.path.join(a.out, "checkpoints"), step, self.model, self.optimizer,
                                self.scheduler, self.sampler)
            if self.rank == 0:
                self._print_progress(step, out, skipped, time.perf_counter() - t0)
        return self._finish(losses, skipped, time.time() - started)

    def _print_progress(self, step: int, out: dict, skipped: int, seconds: float) -> None:
        norm = out["grad_norm"]
        incidents = self.monitor.counters["incidents"] if self.monitor else 0
        print(f"step {step:>4}/{self.args.steps} | loss {out['loss']:.4f} | grad-norm "
              f"{'-' if norm is None else f'{norm:.3g}'} | lr {self.optimizer.param_groups[0]['lr']:.2e} | "
              f"skipped {skipped} | incidents {incidents} | {seconds * 1000:.0f} ms", flush=True)

    def _finish(self, losses: list[float], skipped: int, seconds: float) -> dict[str, Any]:
        a = self.args
        mine = all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        finite = torch.tensor([1.0 if mine else 0.0], device=self._collective)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        finite_losses = [x for x in losses if math.isfinite(x)]
        result = {
            "steps_completed": len(losses),
            "initial_loss": losses[0] if losses else None,
            "final_loss": sum(finite_losses[-3:]) / len(finite_losses[-3:]) if finite_losses else None,
            "losses": [x if math.isfinite(x) else None for x in losses],
            "skipped_steps": skipped,
            "params_finite": bool(finite.item() == 1.0),
            "incidents": self.monitor.counters["incidents"] if self.monitor else 0,
            "monitor": dict(self.monitor.counters) if self.monitor else None,
            "world_size": torch.distributed.get_world_size(),
            "tp": a.tp, "pp": a.pp, "dp": self.dp,
            "precision": a.precision, "distributed_optimizer": a.distributed_optimizer,
            "device": self.device, "seconds": round(seconds, 3),
        }
        if self.rank == 0:
            os.makedirs(a.out, exist_ok=True)
            path = os.path.join(a.out, "result.json")
            with open(path + ".tmp", "w", encoding="utf-8") as handle:
                json.dump(result, handle, indent=2)
            os.replace(path + ".tmp", path)
            print(f"done: {len(losses)} steps, loss {result['initial_loss']:.4f} -> {result['final_loss']:.4f}, "
                  f"skipped {skipped}, incidents {result['incidents']}, params finite: {result['params_finite']} "
                  f"-> {path}", flush=True)
        return result

