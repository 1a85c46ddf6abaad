"""What a drill does to a tensor: the fault menu of :mod:`megatron_patches.inject` (issue 40).

A fault is a kind applied to a scope of one tensor (a gradient, a weight, an optimizer-state
slot, a module's output). Kinds that change values: ``nan``, ``inf``, ``saturate`` (the dtype's
largest finite value), ``spike`` and ``growth`` (multiply by ``factor``), ``scale`` (multiply by
``factor``, default 2), ``sign`` (flip the sign), ``noise`` (``x * (1 + factor * e)``, ``e`` drawn
from N(0, 1) per element, default ``factor`` 0.01: Gaussian noise of 1 %), ``bitflip`` (flip
``bit`` in each element of the scope, or ``bits=N`` distinct bits drawn per element from the
whole word).

Keys read here (``inject.parse_spec`` hands them over):

- ``bit``: a bit index from the least significant (0-based), or a name: ``exponent_high`` (the
  highest exponent bit, the default: the value jumps by 2^(2^(e-1)) or turns Inf), ``mantissa_high``
  (the highest mantissa bit: the value moves by up to half of itself), ``mantissa_low`` (bit 0: by
  one unit in the last place);
- ``bits``: flip N distinct bits per element, drawn from ``seed`` (bitflip only, not with ``bit``);
- ``scope``: ``element`` (one element drawn from ``seed``), ``row`` (one row drawn from ``seed``;
  a 1-D tensor, such as a bias or a distributed-optimizer shard, gives a run of 64 elements),
  ``1pct`` / ``10pct`` (that share of the elements, drawn from ``seed``), ``all``. Without
  ``scope``: the first element, or the whole tensor for spike, growth, scale and noise (the
  drills' behaviour before the menu);
- ``seed``: draws the elements, the bits and the noise (default 0), the same on every rank;
- ``slot``: ``phase=state`` only, the Adam state corrupted: ``exp_avg`` (default) or ``exp_avg_sq``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .errors import ConfigError

VALUE_KINDS = ("nan", "inf", "spike", "bitflip", "saturate", "growth", "sign", "scale", "noise")
"""Kinds that change a tensor's values (poison and kill act elsewhere)."""
NEW_KINDS = ("sign", "scale", "noise")
SCOPES = ("element", "row", "1pct", "10pct", "all")
SLOTS = ("exp_avg", "exp_avg_sq")
KEYS = ("scope", "seed", "bits", "slot")
BIT_NAMES = ("exponent_high", "mantissa_high", "mantissa_low")
FACTOR_KINDS = {"spike": 1.0e4, "growth": 1.5, "scale": 2.0, "noise": 0.01}
"""Kinds that take ``factor``, with its default."""
_WHOLE = ("spike", "growth", "scale", "noise")
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_ROW_1D = 64
_INT_TYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def read_keys(kind: str, values: dict, text: str, phase: str) -> dict:
    """The menu's fields of a spec from its ``key=value`` strings (``bit``, ``bits``, ``factor``,
    ``scope``, ``seed``, ``slot``); a bad one raises ConfigError naming the spec."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"injection {text!r}: {why}")

    def integer(key: str, minimum: int) -> int:
        try:
            number = int(values[key])
        except ValueError:
            raise refuse(f"{key} must be an integer, got {values[key]!r}") from None
        if number < minimum:
            raise refuse(f"{key} must be >= {minimum}, got {number}")
        return number

    fields: dict[str, Any] = {}
    if kind in FACTOR_KINDS:
        fields["factor"] = FACTOR_KINDS[kind]
    for key in ("bit", "bits"):
        if key in values and kind != "bitflip":
            raise refuse(f"{key} applies to bitflip only")
    if "bit" in values and "bits" in values:
        raise refuse("bit and bits exclude each other (one named bit, or N bits drawn per element)")
    if "bit" in values:
        fields["bit"] = values["bit"] if values["bit"] in BIT_NAMES else None
        if fields["bit"] is None:
            if not values["bit"].lstrip("-").isdigit():
                raise refuse(f"bit must be an integer or one of {', '.join(BIT_NAMES)}, got {values['bit']!r}")
            fields["bit"] = integer("bit", 0)
    if "bits" in values:
        fields["bits"] = integer("bits", 1)
    if "factor" in values:
        if kind not in FACTOR_KINDS:
            raise refuse(f"factor applies to {', '.join(FACTOR_KINDS)} only")
        try:
            fields["factor"] = float(values["factor"])
        except ValueError:
            raise refuse(f"factor must be a number, got {values['factor']!r}") from None
    if "scope" in values:
        if values["scope"] not in SCOPES:
            raise refuse(f"scope must be one of {', '.join(SCOPES)}, got {values['scope']!r}")
        fields["scope"] = values["scope"]
    if "seed" in values:
        fields["seed"] = integer("seed", 0)
    if "slot" in values:
        if phase != "state":
            raise refuse("slot applies to phase=state only")
        if values["slot"] not in SLOTS:
            raise refuse(f"slot must be one of {', '.join(SLOTS)}, got {values['slot']!r}")
        fields["slot"] = values["slot"]
    return fields


def optimizer_states(optimizer: Any) -> dict[int, Mapping[str, Any]]:
    """{id(parameter): its state} over the torch optimizers ``optimizer`` steps with: each leaf's
    of a megatron-core ChainedOptimizer (MoE: dense and expert leaves), or its own."""
    states: dict[int, Mapping[str, Any]] = {}
    for leaf in getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else []):
        for param, state in getattr(leaf.__dict__.get("optimizer", leaf), "state", {}).items():
            states[id(param)] = state
    return states


def held_tensors(weight: torch.Tensor, states: Mapping[int, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """What a rank holds for a weight its optimizer steps (an entry's ``main``: the main weight or
    its shard): ``weight`` itself and each floating state tensor of it (``exp_avg``, ``exp_avg_sq``;
    ``states``: :func:`optimizer_states`), in name order."""
    return {"weight": weight, **{key: value for key, value in sorted(states.get(id(weight), {}).items())
                                 if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0}}


def optimizer_state(optimizer: Any, entries: list) -> list[tuple[str, int, Mapping[str, torch.Tensor]]]:
    """(global name, forward order, Adam state) of each of ``entries`` (the monitor's, for one
    optimizer) whose main weight has a state in the optimizer this rank steps (under the
    distributed optimizer, its shard's); empty before the first update creates the state."""
    states = optimizer_states(optimizer)
    return [(entry.info.name, entry.info.order, states[id(entry.main)]) for entry in entries
            if entry.main is not None and states.get(id(entry.main))]


def _indices(spec: Any, tensor: torch.Tensor, generator: torch.Generator) -> Optional[torch.Tensor]:
    """Flat indices of the elements ``spec``'s scope covers in ``tensor``; None for all of them."""
    n = tensor.numel()
    scope = spec.scope or ("all" if spec.kind in _WHOLE else None)
    if scope is None:
        return torch.zeros(1, dtype=torch.long)
    if scope == "all":
        return None
    if scope == "element":
        return torch.randint(n, (1,), generator=generator)
    if scope == "row":
        width = tensor[0].numel() if tensor.dim() >= 2 else min(n, _ROW_1D)
        start = int(torch.randint(n // width, (1,), generator=generator)) * width
        return torch.arange(start, start + width)
    share = 100 if scope == "1pct" else 10
    return torch.randperm(n, generator=generator)[:max(1, n // share)]


def _bit_masks(spec: Any, dtype: torch.dtype, count: int, generator: torch.Generator) -> torch.Tensor:
    """One XOR mask per element (int64), as the bit pattern of a ``width``-bit signed integer."""
    width = torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits
    if spec.bits is not None:
        if spec.bits > width:
            raise ConfigError(f"injection {spec.text!r}: bits must be <= {width} for {dtype}, got {spec.bits}")
        picks = torch.rand(count, width, generator=generator).argsort(dim=1)[:, :spec.bits]
        masks = (torch.ones_like(picks) << picks).sum(dim=1)
    else:
        named = {"exponent_high": width - 2, "mantissa_high": _MANTISSA.get(dtype, 1) - 1, "mantissa_low": 0}
        bit = width - 2 if spec.bit is None else named.get(spec.bit, spec.bit)
        if bit >= width:
            raise ConfigError(f"bitflip: bit must be < {width} for {dtype}, got {bit}")
        masks = torch.full((count,), (1 << bit) - (1 << 64 if bit == 63 else 0), dtype=torch.int64)
    if width == 64:  # int64 shifts and sums wrap already: the top bit is the sign bit
        return masks
    half = 1 << (width - 1)
    return (masks + half) % (1 << width) - half  # the sign bit as a negative number of that width


def _changed(spec: Any, values: torch.Tensor, factor: float, generator: torch.Generator) -> torch.Tensor:
    """``values`` (a flat copy) as the fault leaves them; integers (token ids) are scaled and
    noised in float64 and rounded back."""
    kind = spec.kind
    if not values.is_floating_point() and kind in ("spike", "growth", "scale", "noise"):
        return _changed(spec, values.double(), factor, generator).round().to(values.dtype)
    if kind in ("nan", "inf", "saturate"):
        fill = {"nan": float("nan"), "inf": float("inf"), "saturate": torch.finfo(values.dtype).max}[kind]
        return torch.full_like(values, fill)
    if kind in ("spike", "growth", "scale"):
        return values * factor
    if kind == "sign":
        return -values
    if kind == "noise":
        noise = torch.randn(values.shape, generator=generator, dtype=torch.float32).to(values.device)
        return (values.float() * (1.0 + factor * noise)).to(values.dtype)
    if kind == "bitflip":
        int_type = values.dtype if not values.is_floating_point() else _INT_TYPES[values.element_size()]
        masks = _bit_masks(spec, values.dtype, values.numel(), generator).to(int_type).to(values.device)
        return (values.view(int_type) ^ masks).view(values.dtype)
    raise ConfigError(f"injection {spec.text!r}: kind {kind!r} changes no tensor")


def corrupt(spec: Any, tensor: Any, factor: Optional[float] = None) -> bool:
    """Apply ``spec``'s fault to ``tensor`` in place (a contiguous tensor, or an Adam state from
    :func:`optimizer_state`, of which ``spec.slot`` is taken); ``factor`` overrides the spec's (a
    growth drill's n-th step). Returns whether anything was there to corrupt."""
    if isinstance(tensor, Mapping):
        tensor = tensor.get(spec.slot)
    if tensor is None or tensor.numel() == 0:
        return False
    generator = torch.Generator().manual_seed(spec.seed)
    flat = tensor.view(-1)
    index = _indices(spec, tensor, generator)
    factor = spec.factor if factor is None else factor
    with torch.no_grad():
        if index is None:
            flat.copy_(_changed(spec, flat.clone(), factor, generator))
        else:
            index = index.to(flat.device)
            flat[index] = _changed(spec, flat[index], factor, generator)
    return True
