"""What the tiny-GPT harness trains: data, model and optimizer, built from megatron-core's own parts.

Each builder reads the harness's parsed arguments (:func:`megatron_patches.testing.tiny_gpt.parse_args`)
and runs after ``parallel_state.initialize_model_parallel``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .data import TextCorpus, TinyCorpus

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_corpus(args: argparse.Namespace, rank: int):
    """The synthetic corpus, or the text under ``--data text:PATH`` (rank 0 says what it read)."""
    if not args.data.startswith("text:"):
        return TinyCorpus(args.vocab, args.seq, seed=args.seed)
    corpus = TextCorpus(args.data[len("text:"):], args.seq, seed=args.seed, max_bytes=int(args.data_max_mib * 2**20))
    if rank == 0:
        print(corpus.describe(), flush=True)
    return corpus


def build_model(args: argparse.Namespace, device: str) -> tuple[Any, Any]:
    """(DDP-wrapped GPTModel on the local layer spec, its TransformerConfig) for this pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = args
    dtype = DTYPES[a.precision]
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
    if device != "cpu":
        model = model.to(device)
    if a.precision != "fp32":
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=a.distributed_optimizer,
        check_for_nan_in_grad=a.check_for_nan_in_grad, overlap_grad_reduce=a.overlap_grad_reduce,
        bucket_size=a.ddp_bucket_size)
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model, config


def build_optimizer(args: argparse.Namespace, model: Any, config: Any, global_batch: int) -> tuple[Any, Any]:
    """(Megatron's optimizer for ``model``, a constant-LR OptimizerParamScheduler over it);
    ``config`` gets the optimizer's loss scaling."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a = args
    opt_config = OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.lr, weight_decay=0.01, clip_grad=1.0,
        bf16=a.precision == "bf16", fp16=a.precision == "fp16",
        initial_loss_scale=a.initial_loss_scale if a.precision == "fp16" else None,
        loss_scale=a.loss_scale if a.precision == "fp16" else None,
        use_distributed_optimizer=a.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=a.lr, max_lr=a.lr, min_lr=a.lr, lr_warmup_steps=0,
        lr_decay_steps=a.steps * global_batch, lr_decay_style="constant",
        start_wd=0.01, end_wd=0.01, wd_incr_steps=a.steps * global_batch, wd_incr_style="constant")
    return optimizer, scheduler
