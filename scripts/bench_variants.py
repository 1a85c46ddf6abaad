"""The guarded and unguarded set-ups ``scripts/bench_overhead.py`` switches between (variants A-E)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

import torch

from bench_measure import HOOK_METHODS, Stopwatch
from megatron_patches.seams import wrappers, patching
from megatron_patches.config import Config
from megatron_patches.seams import build_monitor


# --- variant C: every detector on, built generically --------------------------------------


def _optional_number(tp) -> typing.Optional[type]:
    """float or int when ``tp`` is Optional[float] / Optional[int], else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType) or type(None) not in typing.get_args(tp):
        return None
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    return inner[0] if len(inner) == 1 and inner[0] in (int, float) else None


def all_detectors_config(base: Config) -> tuple[Config, list[str]]:
    """Every boolean ``enabled`` true, check_interval 1, and every Optional number that is None
    a large finite value its validator accepts (its code path runs, it never fires). Walks
    the Config dataclasses, so sections added later are picked up without edits here."""
    data = dataclasses.asdict(base)
    changes = []
    large = {float: (1e30, 1e9, 1e3, 0.999), int: (2**31 - 1, 10**6, 1000, 1)}

    def walk(cls, values: dict, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, where = hints[f.name], prefix + f.name
            if dataclasses.is_dataclass(tp) and isinstance(values[f.name], dict):
                walk(tp, values[f.name], where + ".")
            elif f.name == "enabled" and tp is bool and values[f.name] is not True:
                values[f.name] = True
                changes.append(f"{where}: true")
            elif values[f.name] is None and _optional_number(tp):
                check = f.metadata.get("check") or (lambda v: None)
                value = next((v for v in large[_optional_number(tp)] if check(v) is None), None)
                values[f.name] = value
                changes.append(f"{where}: {'left null (no large value passes its check)' if value is None else value}")

    walk(Config, data, "")
    if data["check_interval"] != 1:
        data["check_interval"] = 1
        changes.append("check_interval: 1")
    return Config.from_dict(data), changes


# --- variant D: the naive baseline ---------------------------------------------------------


def naive_check(optimizer) -> bool:
    """The per-parameter loop as first attempts write it: two kernels and two host reads per
    gradient. True when a gradient holds NaN or Inf."""
    found = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and (torch.isnan(p.grad).any().item() or torch.isinf(p.grad).any().item()):
                found = True
    return found


def naive_prepare_grads(original, check=naive_check):
    """megatron-core's prepare_grads, then the naive check; True (skip the step) on a bad gradient."""

    @functools.wraps(original)
    def prepare_grads(self, *args, **kwargs):
        found_inf = original(self, *args, **kwargs)
        return check(self) or found_inf

    return prepare_grads


class Variants:
    """Switches the process between variants with cheap setattrs; one monitor per patched variant."""

    def __init__(self, report_dir: str, guard: "Stopwatch"):
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        self.chained = ChainedOptimizer
        self.original = ChainedOptimizer.__dict__["prepare_grads"]
        self.naive = naive_prepare_grads(self.original, guard.wrap(naive_check, "naive_check"))
        shipped = Config(report_dir=report_dir)
        default = shipped.replace(grad_history=False)
        all_on, self.all_on_changes = all_detectors_config(default)
        self.configs = {"B": default, "C": all_on, "E": shipped}
        self.monitors = {v: build_monitor(c) for v, c in self.configs.items()}
        for monitor in self.monitors.values():  # time spent inside the guard itself
            for name in HOOK_METHODS:
                setattr(monitor, name, guard.wrap(getattr(monitor, name), name))

    def activate(self, variant: str, optimizer: Any = None) -> None:
        """Make ``variant`` the one the next step runs under (``optimizer``: the one it steps)."""
        # Unwrap first: patching.install() wraps whatever prepare_grads the class holds then.
        patching.uninstall()
        wrappers.set_monitor(None)
        setattr(self.chained, "prepare_grads", self.naive if variant == "D" else self.original)
        if variant in self.monitors:
            patching.install()
            wrappers.set_monitor(self.monitors[variant])
            # The other variants stepped the same optimizer since this one's last update: to its
            # state audit that is a change outside its own updates. Its fingerprints are taken
            # again here, outside the step (the caller activates before it times or counts), so
            # that the step pays what a step of a real run pays: the comparison at the check and
            # the fingerprints after the update.
            monitor = self.monitors[variant]
            for detector in monitor.state.detectors if optimizer is not None else ():
                detector.after_update(optimizer, monitor.state.stage.entries_for(optimizer), True)
