"""Megatron-LM's own training loop from the installed megatron-core package, with a tiny GPT.

From megatron-core 0.17 on, the wheel ships ``megatron/training`` (``pretrain``, ``train_step``,
checkpointing, argument parsing): everything of Megatron-LM's loop but ``pretrain_gpt.py``, whose
providers tell it what to build and how to compute the loss. This module holds our own three
providers, so the real loop runs in CI without a checkout:

- :func:`model_provider`: a megatron-core ``GPTModel`` on the local (non-Transformer-Engine) layer
  spec, configured from Megatron's own parsed arguments; with ``--num-experts`` its layers are
  megatron-core's mixture-of-experts layers (router, token dispatcher, experts, shared experts,
  ``--moe-layer-freq``), built by megatron-core's own block spec as ``pretrain_gpt.py`` does;
- :func:`datasets_provider`: :class:`CountingDataset`, deterministic token sequences whose next
  token is predictable (so the loss falls). As with ``pretrain_gpt.py``, only tensor-parallel rank
  0 of each pipeline stage reads data: Megatron builds the loaders there alone (the provider is
  not marked ``is_distributed``), and the other TP ranks' iterators are None;
- :func:`forward_step`: one micro-batch through the model, the loss as (sum, token count) the way
  the schedules expect it, and Megatron's NaN/Inf loss check when
  ``--check-for-nan-in-loss-and-grad`` is on (the default), as a stock script does it. Its batch
  comes as ``pretrain_gpt.py``'s ``get_batch`` makes it (:func:`get_batch`): nothing on a middle
  pipeline stage; elsewhere TP rank 0 reads and megatron-core's ``get_batch_on_this_tp_rank``
  broadcasts what the stage needs to the other TP ranks; then this CP rank's part. Megatron's
  ``dummy_train_step`` (the iterations a resumed job skips) reads and broadcasts the same way, so
  every TP layout's collectives agree there too.

:func:`run` calls ``megatron.training.pretrain`` with them, in whichever calling convention the
installed release has (0.17: arguments parsed inside ``pretrain``; 0.18+: a config container built
from the parsed arguments first). The guard comes in as users add it: ``import
megatron_patches.apply`` before the loop starts.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch


class CountingDataset(torch.utils.data.Dataset):
    """Sample ``i`` is the sequence ``start, start + step, ...`` (mod the vocabulary) with ``start``
    and ``step`` drawn from ``i`` alone: the same samples on every rank and after every restart."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 attention_mask: bool = False):
        self.num_samples, self.seq_length = int(num_samples), int(seq_length)
        self.vocab_size, self.seed = int(vocab_size), int(seed)
        # Megatron-LM broadcasts a dataloader mask across TP ranks unless told there is none
        # (--no-create-attention-mask-in-dataloader): the causal one, True where masked out.
        self.attention_mask = (torch.triu(torch.ones(1, self.seq_length, self.seq_length), diagonal=1).bool()
                               if attention_mask else None)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        start = int(torch.randint(0, self.vocab_size, (1,), generator=generator))
        step = int(torch.randint(1, 8, (1,), generator=generator))
        sequence = (start + step * torch.arange(self.seq_length + 1)) % self.vocab_size
        sample = {
            "tokens": sequence[:-1].long(),
            "labels": sequence[1:].long(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
        }
        if self.attention_mask is not None:
            sample["attention_mask"] = self.attention_mask
        return sample


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Any = None,
                   config: Any = None, pg_collection: Any = None, **_: Any):
    """A ``GPTModel`` for this pipeline stage, from Megatron's parsed arguments."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    kwargs = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(GPTModel).parameters else {}
    if pg_collection is not None and "pg_collection" in inspect.signature(GPTModel).parameters:
        kwargs["pg_collection"] = pg_collection
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        **kwargs,
    )


def _layer_spec(config: Any, vp_stage: Any):
    """The local layer spec; for a mixture-of-experts model (``--num-experts``) the block spec of
    megatron-core, which puts dense and expert layers where ``--moe-layer-freq`` says."""
    from megatron.core.models.gpt import gpt_layer_specs

    if not getattr(config, "num_moe_experts", None):
        return gpt_layer_specs.get_gpt_layer_local_spec()
    block_spec = gpt_layer_specs.get_gpt_decoder_block_spec
    if "vp_stage" in inspect.signature(block_spec).parameters:
        return block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    return block_spec(config, use_transformer_engine=False)


TRAIN_HEADROOM_BATCHES = 16
"""Global batches the training split holds beyond what Megatron asks for. Megatron's sampler reads
the same first samples either way; a loop that reads past its schedule (an in-process rollback
whose data position is not restored, the tests' negative control) then trains on instead of
running out of data."""


def datasets_provider(train_val_test_num_samples, vp_stage: Any = None):
    """(train, validation, test) datasets of the sizes Megatron asks for (the training split with
    :data:`TRAIN_HEADROOM_BATCHES` more)."""
    from megatron.training import get_args

    args = get_args()
    extra = (TRAIN_HEADROOM_BATCHES * args.global_batch_size, 0, 0)
    mask = bool(getattr(args, "create_attention_mask_in_dataloader", False))
    return tuple(
        CountingDataset(max(int(n), 1) + more, args.seq_length, args.padded_vocab_size, args.seed + split,
                        attention_mask=mask)
        if n else None
        for split, (n, more) in enumerate(zip(train_val_test_num_samples, extra))
    )


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Masked token-loss sum, token count and the (sum, count) pair Megatron logs as ``lm loss``."""
    from megatron.training import get_args

    mask = loss_mask.view(-1).float()
    total = torch.sum(output.view(-1).float() * mask)
    tokens = mask.sum().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
        for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=total, rejection_func=rejected,
                                    message=f"{what} in the loss (megatron_patches.testing.gpt_loop)",
                                    tolerance=0.0, fatal=True)
    return total, tokens, {"lm loss": torch.stack([total.detach().clone(), mask.sum().detach()])}


def _on_this_context_parallel_rank(batch: dict) -> dict:
    """This CP rank's two chunks of each sequence (megatron-core's load-balanced split, as
    ``pretrain_gpt.py``'s ``get_batch`` does); the batch unchanged without context parallelism."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    if "cp_group" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)


def _stage_flags(vp_stage: Any) -> dict:
    """First / last pipeline stage of the model chunk of virtual stage ``vp_stage`` (None: no
    interleaving), and whether multi-token prediction runs there."""
    from megatron.core import parallel_state

    where = {"ignore_virtual": vp_stage is None, "vp_stage": vp_stage}
    flags = {"is_pipeline_first_stage": parallel_state.is_pipeline_first_stage(**where),
             "is_pipeline_last_stage": parallel_state.is_pipeline_last_stage(**where), "mtp_on_this_rank": False}
    from megatron.training import get_args

    mtp_layers = getattr(get_args(), "mtp_num_layers", None)
    if mtp_layers:
        from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

        flags["mtp_on_this_rank"] = bool(mtp_on_this_rank(mtp_num_layers=mtp_layers, **where))
    return flags


def _read_on_tp_rank_zero(data_iterator, flags: dict) -> dict:
    """The micro-batch read by tensor-parallel rank 0 and broadcast by megatron-core's
    ``get_batch_on_this_tp_rank`` (``megatron.core.utils``, the call Megatron's own
    ``dummy_train_step`` makes) to the other TP ranks, which receive it into tensors of the
    configured micro-batch and sequence shapes."""
    from megatron.core import parallel_state, utils
    from megatron.training import get_args

    if not hasattr(utils, "get_batch_on_this_tp_rank"):  # 0.17, 0.18 (not run here): the iterator form
        from megatron.training.utils import get_batch_on_this_tp_rank as older

        return older(data_iterator, mtp_on_this_rank=flags["mtp_on_this_rank"])
    args = get_args()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = next(data_iterator) if tp_rank == 0 else {}
    if torch.cuda.is_available():  # the broadcast is on the device, as pretrain_gpt.py moves it there
        batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    return utils.get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, pipeline_model_parallel_size=args.pipeline_model_parallel_size, **flags)


def get_batch(data_iterator, vp_stage: Any = None) -> Optional[dict]:
    """This rank's micro-batch as ``pretrain_gpt.py`` gets it: None on a middle pipeline stage
    (it reads nothing), else TP rank 0's batch broadcast over the TP group
    (:func:`_read_on_tp_rank_zero`), then this CP rank's part. Where a stage does not need a
    tensor (tokens past the first stage, labels before the last), it is None."""
    flags = _stage_flags(vp_stage)
    if not (flags["is_pipeline_first_stage"] or flags["is_pipeline_last_stage"] or flags["mtp_on_this_rank"]):
        return None
    return _on_this_context_parallel_rank(_read_on_tp_rank_zero(data_iterator, flags))


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch: tokens in, per-token loss out, with the loss function to reduce it. The
    attention mask stays the model's own causal one (the dataloader's, where there is one, is
    the same mask)."""
    from megatron.core.utils import get_attr_wrapped_model

    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage")) or {}
    output = model(batch.get("tokens"), batch.get("position_ids"), None, labels=batch.get("labels"))
    loss_mask = batch.get("loss_mask")
    return output, lambda output_tensor: _loss(loss_mask, output_tensor)


def run() -> None:
    """``megatron.training.pretrain`` with the providers above; Megatron parses ``sys.argv``."""
    from megatron.core.enums import ModelType
    from megatron.training import training

    pretrain = training.pretrain
    parameters = inspect.signature(pretrain).parameters
    common = {"train_valid_test_dataset_provider": datasets_provider, "model_type": ModelType.encoder_or_decoder,
              "forward_step_func": forward_step, "model_provider": model_provider}
    if "cfg_container" not in parameters:  # 0.17: pretrain parses the arguments itself
        pretrain(**common, args_defaults={"tokenizer_type": "NullTokenizer"})
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args), **common)
