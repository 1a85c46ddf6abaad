"""What the mixture-of-experts routers did in the step being checked: the tokens each expert was
sent and whether the routing probabilities were finite.

A MoE fault is often a routing fault: a router whose logits overflowed (probabilities NaN on one
rank), or an expert that received no tokens at all (its gradient is zero; with some kernels and
dispatchers that is where NaNs are reported). By the time the guard checks the gradients the
routing of the step is gone, so it is kept while the step runs: a forward hook on each router
(``...mlp.router``, whose output is ``(probs, routing_map)`` from megatron-core 0.12 to main)
adds this micro-batch's ``routing_map.sum(0)`` (tokens per global expert) and
``isfinite(probs).all()`` to per-layer tensors on the device, on checked steps only. Nothing is
read on the host unless the step becomes an incident (:meth:`RoutingWatch.share`); the record then
carries ``moe_routing`` (:func:`megatron_patches.decide.routing_field`). An expert that got zero tokens is recorded there,
never an incident by itself.

Megatron's rerun of a step in place routes the same tokens again: :meth:`RoutingWatch.restart`
drops the first pass so that the counts are one pass's.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from . import naming

ROUTER_SUFFIX = ".mlp.router"


class RoutingWatch:
    """Per MoE layer, this rank's tokens per expert and router finiteness for one step."""

    def __init__(self, step_of: Callable[[], int], checked: Callable[[int], bool]):
        """``step_of``: the step being made now; ``checked``: whether the guard checks a step."""
        self._step_of, self._checked = step_of, checked
        self._step: Optional[int] = None
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def attach(self, model_chunks: list, ps: Any) -> int:
        """Hook every router of ``model_chunks`` (once per module); returns how many were hooked.
        ``ps``: megatron-core's parallel state, for the routers' names (``Seams.parallel_state``)."""
        hooked = 0
        for name, _, module in naming.name_modules(model_chunks, ps):
            if name.endswith(ROUTER_SUFFIX) and module not in self._hooked:
                self._hooked.add(module)
                module.register_forward_hook(self._hook(name[: -len(".router")]))
                hooked += 1
        return hooked

    def _hook(self, layer: str):
        def hook(module, args, output):
            step = self._step_of()
            if not (isinstance(output, tuple) and len(output) >= 2 and self._checked(step)):
                return None
            probs, routing_map = output[0], output[1]
            if step != self._step:
                self._step, self._layers = step, {}
            with torch.no_grad():
                tokens = (routing_map != 0).sum(0)
                finite = torch.isfinite(probs).all()
            held = self._layers.get(layer)
            self._layers[layer] = (tokens, finite) if held is None else (held[0] + tokens, held[1] & finite)
            return None
        return hook

    def restart(self) -> None:
        """The step is being run again (Megatron's rerun in place): count the new pass only."""
        self._layers = {}

    def share(self, step: int) -> Optional[dict]:
        """This rank's ``{layer: {"tokens_per_expert", "router_finite"}}`` of ``step`` (host reads:
        the slow path only), or None when no router ran in it."""
        if self._step != step or not self._layers:
            return None
        return {layer: {"tokens_per_expert": [int(n) for n in tokens.tolist()], "router_finite": bool(finite)}
                for layer, (tokens, finite) in self._layers.items()}
