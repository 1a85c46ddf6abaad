"""The import path of the source patches ``make patch`` writes into a checkout
(``from megatron_patches import hooks as _mp_hooks``, then ``@_mp_hooks.checked_prepare_grads``
and ``@_mp_hooks.checked_clip_grad_norm``): checkouts patched by any release keep working. The
wrappers themselves live in :mod:`megatron_patches.seams.wrappers`."""

from .seams.wrappers import checked_clip_grad_norm, checked_prepare_grads

__all__ = ["checked_clip_grad_norm", "checked_prepare_grads"]
