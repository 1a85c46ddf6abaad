"""A CPU stand-in for Transformer Engine's ``FusedAdam``, for ``--use-precision-aware-optimizer``.

megatron-core's precision-aware optimizer (``OptimizerConfig.use_precision_aware_optimizer``)
hands its optimizer the low-precision model-parameter shards themselves and keeps their fp32
gradients in ``param.decoupled_grad``; the optimizer holds the master weights and the moments in
the dtypes the config names and writes the updated weights back into the shards. Only Transformer
Engine's ``FusedAdam`` does that, and Transformer Engine needs CUDA: it cannot be installed or run
on these machines. :class:`StandInFusedAdam` is a plain-torch Adam with the part of that interface
megatron-core calls (the constructor keywords, ``initialize_state``, ``get_unscaled_state``,
``set_scaled_state``), written for the tests. It is not Transformer Engine's kernel and is never
used outside the CPU test runtime (:mod:`megatron_patches.testing.megatron_lm_cpu`).

State dtypes: fp32 and bf16 are stored as they are; the scaled ones of Transformer Engine
(fp16 and uint8 moments with per-tensor scales) are refused in one line.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Iterable

import torch

UNSCALED_DTYPES = (torch.float32, torch.bfloat16)
"""Moment and master-weight dtypes the stand-in keeps (Transformer Engine also scales fp16/uint8)."""


class StandInFusedAdam(torch.optim.Optimizer):
    """Adam (AdamW with ``adam_w_mode``) over parameters whose gradients may be decoupled.

    With ``master_weights`` each parameter's update is computed on a ``master_param`` copy in
    ``master_weight_dtype`` and cast into the parameter; with ``use_decoupled_grad`` the gradient
    is read from ``param.decoupled_grad`` (fp32 beside a bf16 parameter) instead of ``.grad``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, **unused: Any):
        for name, dtype in (("master_weight_dtype", master_weight_dtype), ("exp_avg_dtype", exp_avg_dtype),
                            ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in UNSCALED_DTYPES:
                raise ValueError(f"{name}={dtype} needs Transformer Engine's scaled states; the CPU "
                                 f"stand-in FusedAdam keeps {', '.join(map(str, UNSCALED_DTYPES))} only")
        if store_param_remainders:
            raise ValueError("store_param_remainders needs Transformer Engine's FusedAdam (CUDA)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.adam_w_mode, self.master_weights = bool(adam_w_mode), bool(master_weights)
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.dtypes = {"master_param": master_weight_dtype, "exp_avg": exp_avg_dtype,
                       "exp_avg_sq": exp_avg_sq_dtype}

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """Zero moments (and the master copy of ``param``) in their configured dtypes."""
        state = self.state[param]
        state["exp_avg"] = torch.zeros_like(param, dtype=self.dtypes["exp_avg"])
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.dtypes["exp_avg_sq"])
        if self.master_weights:
            state["master_param"] = param.detach().clone().to(self.dtypes["master_param"])

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The named state of ``param`` in fp32 (what a checkpoint saves)."""
        if not self.state[param]:
            self.initialize_state(param)
        return self.state[param][state_name].float()

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store ``unscaled_state`` (fp32, e.g. from a checkpoint) as the named state of ``param``."""
        if not self.state[param]:
            self.initialize_state(param)
        self.state[param][state_name].copy_(unscaled_state)

    def _grad(self, param: torch.Tensor):
        return getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            correction1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            correction2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for param in group["params"]:
                grad = self._grad(param)
                if grad is None:
                    continue
                if not self.state[param]:
                    self.initialize_state(param)
                state = self.state[param]
                weight = state["master_param"].float() if self.master_weights else param.float()
                grad = grad.float()
                if group["weight_decay"] and not self.adam_w_mode:
                    grad = grad + group["weight_decay"] * weight
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq / correction2).sqrt_().add_(group["eps"])
                if group["weight_decay"] and self.adam_w_mode:
                    weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.addcdiv_(exp_avg, denom, value=-group["lr"] / correction1)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                if self.master_weights:
                    state["master_param"].copy_(weight)
                param.copy_(weight)
        return loss



_TE_OPTIMIZERS = "transformer_engine.pytorch.optimizers"
_switched: list[tuple[Any, str, Any]] = []
"""Module globals of megatron-core switched to the stand-in, with their values before."""


def redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the CPU runtime (:mod:`megatron_patches.testing.cpu`):

    - ``OptimizerConfig.__post_init__`` imports ``FusedAdam`` from ``transformer_engine.pytorch.optimizers``
      to check its keywords; while it runs for a precision-aware config, that import finds the stand-in;
    - ``_get_megatron_optimizer_based_on_param_groups`` builds its Adam from the module global ``Adam``
      chosen at import (torch's AdamW here); for a precision-aware config (CPU offload included: its
      device-side optimizer is that ``Adam``) the process switches to the stand-in, and megatron-core's distributed optimizer takes its Transformer Engine paths from then on
      (``step`` kept in the param groups, as FusedAdam keeps it), see :func:`switch`.
    Empty on a megatron-core without the precision-aware optimizer, or with Transformer Engine or Apex.
    """
    from megatron.core import optimizer as optimizer_package
    from megatron.core.optimizer import optimizer_config

    config_class = optimizer_config.OptimizerConfig
    build = optimizer_package.__dict__.get("_get_megatron_optimizer_based_on_param_groups")
    if (build is None or "__post_init__" not in config_class.__dict__
            or "use_precision_aware_optimizer" not in config_class.__dataclass_fields__
            or not getattr(optimizer_package, "USING_PYTORCH_OPTIMIZER", False)):
        return []
    return [(config_class, "__post_init__", _finding_stand_in(config_class.__dict__["__post_init__"])),
            (optimizer_package, "_get_megatron_optimizer_based_on_param_groups", _switching_to_stand_in(build))]


def _precision_aware(config: Any) -> bool:
    return bool(getattr(config, "use_precision_aware_optimizer", False))


def _finding_stand_in(original):
    @functools.wraps(original)
    def post_init(self):
        if not _precision_aware(self) or getattr(self, "optimizer_cpu_offload", False) or _TE_OPTIMIZERS in sys.modules:
            return original(self)
        from megatron.core import utils

        utils.get_te_version()  # cached "no Transformer Engine" before the stand-in module appears
        modules = {}
        for name in ("transformer_engine", "transformer_engine.pytorch", _TE_OPTIMIZERS):
            modules[name] = types.ModuleType(name, "CPU stand-in (megatron_patches.testing.fused_adam)")
        modules[_TE_OPTIMIZERS].FusedAdam = StandInFusedAdam
        sys.modules.update(modules)
        try:
            return original(self)
        finally:
            for name in modules:
                del sys.modules[name]

    return post_init


def _switching_to_stand_in(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def build(*args, **kwargs):
        if _precision_aware(signature.bind(*args, **kwargs).arguments.get("config")):
            switch()
        return original(*args, **kwargs)

    return build


def switch() -> None:
    """Make the stand-in megatron-core's fused Adam for the rest of the process (idempotent)."""
    if _switched:
        return
    from megatron.core import optimizer as optimizer_package
    from megatron.core.optimizer import distrib_optimizer

    for owner, name, value in ((optimizer_package, "Adam", StandInFusedAdam),
                               (optimizer_package, "USING_PYTORCH_OPTIMIZER", False),
                               (distrib_optimizer, "HAVE_APEX_OR_TE", True),
                               (distrib_optimizer, "USING_TE_OPTIMIZER", True)):
        _switched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)


def restore() -> None:
    """Undo :func:`switch` (the CPU runtime's uninstall calls it)."""
    while _switched:
        owner, name, value = _switched.pop()
        setattr(owner, name, value)
