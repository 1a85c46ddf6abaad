"""Run Megatron-Bridge's pretraining loop (``megatron.bridge.training.pretrain.pretrain``) on CPU ranks
with a tiny GPT: mock data, megatron-core's local layer spec, gloo.

    MEGATRON_PATCHES_CONFIG=guard.yaml OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        -m megatron_patches.testing.pretrain_bridge_cpu --out DIR [--iters 5] [--save CKPT --save-interval 2] \\
        [--no-guard]

For tests only (``tests/trainings/test_bridge.py``; docs/bridge.md). The order of the opening lines is the point:
the CPU stand-ins (:mod:`megatron_patches.testing.bridge_cpu`) before anything imports Megatron-Bridge,
then ``import megatron_patches.apply`` as a Bridge user's script would have it, *before* its own
``megatron.bridge`` imports (Bridge's ``training/optim.py`` binds megatron-core's
``get_megatron_optimizer`` by name when it is imported; imported later, the guard builds no parameter
names), then Bridge's CUDA redirects. ``--no-guard`` leaves the import out: the unguarded run a guarded
one is compared with.

The last rank writes ``DIR/steps.jsonl`` (one line per iteration, numbered as Bridge's log, from a
Bridge ``Callback``: the exact loss and learning rate as ``float.hex``, the grad norm, whether Bridge
skipped it); each rank a SHA-256 of its parameters at the end (``DIR/weights.json`` on rank 0,
``weights_rank1.json`` beside it), so two runs can be compared bit for bit. ``--layout`` splits the
two ranks as :data:`LAYOUTS` lists (DP2 by default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

WITHOUT_GUARD = "--no-guard"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_patches.testing.pretrain_bridge_cpu")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes steps.jsonl and weights.json")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--save", default=None, help="Bridge's checkpoint directory (save and load)")
    parser.add_argument("--save-interval", type=int, default=1000)
    parser.add_argument(WITHOUT_GUARD, action="store_true", help="leave `import megatron_patches.apply` out")
    parser.add_argument("--filter-warnings", action="store_true",
                        help="Bridge's default LoggerConfig.filter_warnings=True (hides the guard's warning lines)")
    parser.add_argument("--guard-after-bridge", action="store_true",
                        help="put `import megatron_patches.apply` after Bridge's own imports instead of before")
    parser.add_argument("--iterations-to-skip", type=int, nargs="*", default=[],
                        help="Bridge's train.iterations_to_skip (as logged): the run a blacklisting rollback equals")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2",
                        help="how the two ranks split the model: "
                        + "; ".join(f"{name}: {what}" for name, (what, _, _) in LAYOUTS.items()))
    return parser.parse_args(argv)


LAYOUTS = {
    "dp2": ("two data-parallel replicas, fp32, no distributed optimizer", {}, {}),
    "dp2-bf16-distopt": ("two replicas, bf16 with the distributed optimizer",
                         {"bf16": True, "params_dtype": "bfloat16"}, {"bf16": True, "use_distributed_optimizer": True}),
    "tp2": ("tensor parallel over both ranks, sequence parallel on", {"tensor_model_parallel_size": 2,
                                                                     "sequence_parallel": True}, {}),
    "pp2": ("one layer per pipeline stage", {"pipeline_model_parallel_size": 2}, {}),
    "ep2": ("MoE, 4 experts, expert parallel over both ranks (two replicas of the dense part)",
            {"num_moe_experts": 4, "expert_model_parallel_size": 2, "moe_router_topk": 2,
             "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall", "moe_aux_loss_coeff": 0.01},
            {}),
}
"""``--layout``: (what it is, GPTModelProvider fields, OptimizerConfig fields)."""


def tiny_gpt_config(args: argparse.Namespace) -> Any:
    """Bridge's own config container for a 2-layer, hidden-64 GPT that trains on CPU ranks."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,
                                                 TrainingConfig, ValidationConfig)

    _, model_fields, optimizer_fields = LAYOUTS[args.layout]
    model_fields = dict(model_fields)
    if model_fields.get("params_dtype") == "bfloat16":
        model_fields["params_dtype"] = torch.bfloat16
    distributed = bool(optimizer_fields.get("use_distributed_optimizer", False))
    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=32,
        vocab_size=4096, make_vocab_size_divisible_by=128, transformer_layer_spec=local_layer_spec,
        **{"bf16": False, "params_dtype": torch.float32, **model_fields}, use_cpu_initialization=True,
        # CUDA-only fusions off, as for Megatron-LM's loop on CPU.
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=args.iters, global_batch_size=4, micro_batch_size=2,
                             iterations_to_skip=list(args.iterations_to_skip)),
        validation=ValidationConfig(eval_interval=1000, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=0.0,
                                  **{"bf16": False, "fp16": False, "use_distributed_optimizer": False,
                                     **optimizer_fields}),
        # start/end weight decay have no default in Bridge 0.6.2 (None fails an assert >= 0.0).
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.01,
                                  end_weight_decay=0.01),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=distributed),
        dataset=MockGPTDatasetConfig(seq_length=32, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     split="9999,8,2", dataloader_type="single",
                                     skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1, filter_warnings=args.filter_warnings),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=4096),
        checkpoint=CheckpointConfig(save=args.save, load=args.save, save_interval=args.save_interval,
                                    ckpt_format="torch_dist"),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        rng=RNGConfig(seed=1234),
    )


def _recorder(out: Path) -> Any:
    """A Bridge ``Callback`` that records each iteration (on the last rank, which holds the loss
    under a pipeline) and every rank's final weights."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class StepRecorder(Callback):
        def on_train_step_end(self, context: Any) -> None:
            if torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
                return
            loss = (context.loss_dict or {}).get("lm loss")
            record = {
                # Bridge counts train_state.step up after this event: its log's "iteration N" is step + 1.
                "iteration": context.state.train_state.step + 1,
                "skipped": bool(context.skipped_iter),
                "loss": None if loss is None else float(loss).hex(),
                "grad_norm": None if context.grad_norm is None else float(context.grad_norm).hex(),
                "lr": float(context.optimizer.param_groups[0]["lr"]).hex(),
            }
            with open(out / "steps.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

        def on_train_end(self, context: Any) -> None:
            rank = torch.distributed.get_rank()
            digest = hashlib.sha256()
            finite = True
            for chunk in context.model:
                for name, param in sorted(chunk.named_parameters()):
                    data = param.detach().float().contiguous()
                    finite = finite and bool(torch.isfinite(data).all())
                    digest.update(name.encode())
                    digest.update(data.numpy().tobytes())
            name = "weights.json" if rank == 0 else f"weights_rank{rank}.json"
            (out / name).write_text(json.dumps({"sha256": digest.hexdigest(), "finite": finite}))

    return StepRecorder()


def main(argv: list[str] | None = None) -> None:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    from megatron_patches.testing import bridge_cpu

    bridge_cpu.install_stand_ins()
    if not args.no_guard and not args.guard_after_bridge:
        import megatron_patches.apply  # noqa: F401  (the user's one line, before Bridge is imported)
    bridge_cpu.install()

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    if args.guard_after_bridge:
        import megatron_patches.apply  # noqa: F401,F811  (the same line, placed after Bridge's imports)

    args.out.mkdir(parents=True, exist_ok=True)
    pretrain(tiny_gpt_config(args), forward_step, callbacks=[_recorder(args.out)])


if __name__ == "__main__":
    # Bridge's checkpoint writer starts a process of its own: that child imports this file again and
    # must not train (hence the guard above, and no work at import).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
