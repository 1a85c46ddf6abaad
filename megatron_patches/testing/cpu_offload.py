"""The device/host split of megatron-core's optimizer CPU offload, on a machine without a device.

``--optimizer-cpu-offload`` wraps the optimizer in ``HybridDeviceOptimizer``: the first
``--optimizer-offload-fraction`` of the parameters' elements get host copies stepped by a CPU
optimizer (torch's AdamW), the rest stay with the device optimizer; gradients go to the host
copies inside ``step()`` and the updated copies come back after it. It tells device from host
parameters by ``param.is_cuda``. On these CPU-only machines every tensor is a host tensor, so
megatron-core offloads nothing and then fails looking up host copies that do not exist.

:func:`redirects` replaces ``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` with
:func:`_split_as_on_a_device`, which counts every parameter as a device parameter and makes the
same split as on a GPU (host copies for the first fraction, fp32 copies where updates run in fp32,
no pinned memory: pinning needs CUDA). A test stand-in for the device/host boundary, used only by
the CPU test runtime (:mod:`megatron_patches.testing.cpu`); the command line must say
``--no-pin-cpu-grads --no-pin-cpu-params``.
"""

from __future__ import annotations

from typing import Any

import torch


def _split_as_on_a_device(self, offload_fraction: float):
    """(host groups, device groups, {param: host copy}, {host copy: param}, {param: fp32 copy})."""
    total = sum(p.numel() for group in self.param_groups for p in group["params"])
    threshold, offloaded = offload_fraction * total, 0
    host_groups, device_groups = [], []
    host_copy, param_of_copy, fp32_copy = {}, {}, {}
    for group in self.param_groups:
        host, device = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            stepped, to_host = param, offloaded < threshold
            if to_host:
                stepped = param.detach().clone()
                offloaded += param.numel()
            if self.param_update_in_fp32 and stepped.dtype != torch.float32:
                stepped = stepped.detach().clone().float()
                fp32_copy[param] = stepped
            if to_host:
                host_copy[param], param_of_copy[stepped] = stepped, param
            (host if to_host else device)["params"].append(stepped)
        host_groups += [host] if host["params"] else []
        device_groups += [device] if device["params"] else []
    return host_groups, device_groups, host_copy, param_of_copy, fp32_copy


def redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the CPU runtime; empty without ``HybridDeviceOptimizer``."""
    try:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    except ImportError:  # pragma: no cover - core lines before CPU offload
        return []
    if "_get_sub_optimizer_param_groups" not in HybridDeviceOptimizer.__dict__:
        return []
    return [(HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", _split_as_on_a_device)]
