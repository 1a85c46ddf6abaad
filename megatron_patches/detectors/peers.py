"""Peers: each gradient judged against others of the same step, so there is no warm-up.

The history detector needs 20 accepted steps per series, and the magnitude check's 1e6 is far
above a finite spike, so a x1,000 spike in one tensor on the first steps of a job (or after a
restart without saved statistics) passes both. This detector keeps no history at all.

- ``peer_ratio`` (tensors inside transformer layers). Every layer holds the same tensors
  (``decoder.layers.{i}.mlp.linear_fc1.weight`` for every ``i``: one *role*). Raw norms of one
  role differ a lot from layer to layer when a whole layer's gradient swings, so each tensor is
  first put in relation to its own layer: ``q = norm / median norm of its layer's tensors``. The
  tensor is flagged when its ``q`` is more than ``ratio`` times the median ``q`` of the same
  role in the other layers.
- ``share`` (tensors outside the layers: word and position embeddings, final norm, output
  layer, which have no peers): ``norm / norm of the rest of the model``, flagged above
  ``share_max``. It sees a spike only in a tensor that normally holds a share of at least
  ``share_max / factor`` (docs/detectors.md has the figures).

How it rides on the monitor's one all-reduce: every tensor's squared norm, weighted by
``Entry.weight`` (tensor-parallel shards add up; a data-parallel replica or a distributed-
optimizer shard counts once), is added to a slot of this detector's piece of the vector:
``layer * roles + role`` for layer tensors (pipeline stages fill their own layers' slots),
one of ``_PEERLESS`` slots chosen by a hash of the name for the others (two names sharing a
slot are judged together). Roles are numbered in the sorted order of the layer tensors' names
(taken from the model, as a distributed-optimizer rank holds shards of only some tensors),
the same on every stage of a model built from one layer spec. Each rank with layer tensors adds
a hash of its role table, its square and its role count, so a job whose stages differ
(heterogeneous layers) is seen from the reduced values alone, identically on every rank: the
detector logs one warning and stays off, as it does when ``max_slots`` is too small. The layer
slots number layers x tensors per layer of the model (at most ``max_slots``), agreed by the ranks
at the first check (:meth:`Detector.sizes`). The
verdict is numpy over floats the monitor has already read; the fast path adds device ops only.

Not seen: a spike shared by the same tensor in every layer (its peers rise with it: the
history and magnitude checks see that), the tensors of a one-layer model, drops (only
upward outliers are flagged), and a spike too small to lift a small peerless tensor's share
over ``share_max``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import collectives, naming
from .base import CheckContext, Detector, Rotation

log = logging.getLogger("megatron_patches")

_LAYERED, _HASH, _HASH_SQ, _ROLES, _OVER, _HEAD = 0, 1, 2, 3, 4, 5
"""Slots: ranks holding layer tensors, the sums of their role-table hashes and of the hashes'
squares (all equal iff layered * sum(h^2) == sum(h)^2), the sum of their role counts, ranks
whose tensors did not fit (``max_slots``)."""
_PEERLESS = 32
"""Slots for the tensors outside the layers, after the head; then the layer slots."""
_LAYER = re.compile(r"\blayers\.\d+\.")
_TINY = 1e-30
_TRACE = "MEGATRON_PATCHES_PEERS_TRACE"
"""Measurement aid: a file rank 0 appends each check's figures to (JSON lines)."""


def role_of(name: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> ``decoder.layers.*.mlp.linear_fc1.weight``."""
    return _LAYER.sub("layers.*.", name, count=1)


def _peerless_slot(name: str) -> int:
    return zlib.crc32(name.encode()) % _PEERLESS


class PeersDetector(Detector):
    """Outliers among the same tensor of all layers, and peerless tensors holding too large a
    share of the model's gradient (kind ``peers``), from the first step on."""

    name = "peers"

    def __init__(self, cfg: Any, parallel_state: Callable[[], Any]):
        """``parallel_state``: megatron-core's, for the parameters' names (``Seams.parallel_state``)."""
        self.cfg = cfg
        self.parallel_state = parallel_state
        self._rotation = Rotation(cfg.interval)
        self._checks = 0
        self._active = False
        self._layout: Optional[tuple] = None
        self._index: Optional[torch.Tensor] = None
        self._head: Optional[torch.Tensor] = None  # the piece's start (the head's slots), fixed for a layout
        self._plan: Optional[tuple] = None
        self._roles: list[str] = []
        self._model_roles: Optional[list] = None  # from the model chunks, once
        self._hash = 0.0
        self._over = False
        self._capacity = cfg.max_slots
        """Layer slots in the vector: layers x tensors per layer of the model, at most max_slots."""
        self._off_logged = False
        self._flags: set = set()  # (role, layer) pairs and peerless slots flagged this check
        self._tripped: list = []
        self._last: Optional[tuple] = None
        self.max_ratio = 0.0
        """Largest peer ratio seen on accepted checks: the clean-run margin to ``ratio``."""
        self.max_share = 0.0
        """Largest peerless share seen on accepted checks: the margin to ``share_max``."""

    # --- fast path -------------------------------------------------------------------

    def width(self) -> int:
        return _HEAD + _PEERLESS + self._capacity

    def sizes(self, entries: list) -> list:
        """[layers, tensors per layer] as this rank sees them (the model's role table where known)."""
        layers = max((e.info.layer + 1 for e in entries if e.info.layer is not None), default=0)
        roles = self._model_roles or {role_of(e.info.name) for e in entries if e.info.layer is not None}
        return [layers, len(roles)]

    def size(self, agreed: list) -> None:
        layers, roles = agreed
        self._capacity = min(self.cfg.max_slots, layers * roles)

    def plan(self, ctx: CheckContext) -> Optional[tuple]:
        """The whole piece is the check's to fill: the head's constants, and the check's weighted
        squares (each norm squared times Entry.weight) added into their slots by the same op as
        its per-layer sums (no device call of this detector's own)."""
        self._checks += 1
        self._active = self._rotation.due(self._checks)
        self._flags, self._tripped, self._last = set(), [], None
        if not self._active or ctx.norms is None:
            return None
        return self._slots(ctx)

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        if not self._active:
            return []
        layered, over = reduced[_LAYERED], reduced[_OVER]
        roles = round(reduced[_ROLES] / layered) if layered > 0 else 0
        layers = len(ctx.layer_norms or []) - 2
        if over > 0 or layers * roles > self._capacity:
            self._warn_off(f"the model needs more than max_slots={self.cfg.max_slots} slots "
                           f"(layers x tensors per layer)")
            return []
        if layered * reduced[_HASH_SQ] != reduced[_HASH] ** 2 or roles * layered != reduced[_ROLES]:
            self._warn_off("the pipeline stages' layers hold different tensors")
            return []
        tripped = []
        ratios = None
        if roles and layers >= 2:
            start = _HEAD + _PEERLESS
            squares = np.maximum(np.array(reduced[start:start + layers * roles]), 0.0).reshape(layers, roles)
            ratios = _ratio_to_peers(squares)
            names = self._roles if len(self._roles) == roles else [f"role {k}" for k in range(roles)]
            for layer, role in zip(*np.nonzero(ratios > self.cfg.ratio)):
                self._flags.add((names[role], int(layer)))
                tripped.append({"tensor": names[role].replace("layers.*.", f"layers.{layer}.", 1),
                                "kind": "peer_ratio", "ratio": round(float(ratios[layer, role]), 2)})
        total_sq = ctx.total_norm ** 2
        peerless = np.maximum(np.array(reduced[_HEAD:_HEAD + _PEERLESS]), 0.0)
        shares = np.sqrt(peerless) / np.sqrt(np.maximum(total_sq - peerless, _TINY))
        shares = np.where((peerless > 0) & np.isfinite(shares), shares, np.nan)
        for slot in np.nonzero(shares > self.cfg.share_max)[0]:
            self._flags.add(int(slot))
            tripped.append({"tensor": self._peerless_names(int(slot)), "kind": "share",
                            "share": round(float(shares[slot]), 2)})
        self._tripped = tripped
        self._last = (_nanmax(ratios), _nanmax(shares))
        if os.environ.get(_TRACE) and collectives.rank() == 0:
            self._trace(ctx.step, ratios, shares)
        return ["peers"] if tripped else []

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        if accepted and self._last is not None:
            self.max_ratio = max(self.max_ratio, self._last[0])
            self.max_share = max(self.max_share, self._last[1])
        self._last = None

    def before_reduction(self, model_chunks: list, step: int) -> None:
        # The role table comes from the model, not from the optimizer's entries: with the
        # distributed optimizer a rank holds shards of only some tensors, and every rank must
        # number the roles alike.
        if self._model_roles is None:
            infos = naming.name_parameters(model_chunks, self.parallel_state()).values()
            self._model_roles = sorted({role_of(i.name) for i in infos if i.layer is not None})

    # --- slow path -------------------------------------------------------------------

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        named: dict[int, list] = {}
        for i, entry in enumerate(ctx.entries):
            if entry.info.layer is not None and (role_of(entry.info.name), entry.info.layer) in self._flags:
                named[i] = ["peer_ratio"]
            elif entry.info.layer is None and _peerless_slot(entry.info.name) in self._flags:
                named[i] = ["share"]
        return named

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        if not self._tripped:
            return {}
        return {"peers": {"tripped": self._tripped, "ratio": self.cfg.ratio, "share_max": self.cfg.share_max}}

    # --- state -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": 1, "checks": self._checks, "max_ratio": self.max_ratio, "max_share": self.max_share}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self._checks = int(state.get("checks", 0))
            self.max_ratio = float(state.get("max_ratio", 0.0))
            self.max_share = float(state.get("max_share", 0.0))

    # --- helpers ---------------------------------------------------------------------

    def _slots(self, ctx: CheckContext) -> tuple:
        """This detector's :meth:`plan`: (the piece's start, the head's values; each tensor's slot in
        the piece, None when they did not fit), made once per layout."""
        layout = tuple(map(id, ctx.entries))
        if layout != self._layout:
            roles = sorted({role_of(e.info.name) for e in ctx.entries if e.info.layer is not None})
            if self._model_roles is not None and set(roles) <= set(self._model_roles):
                roles = self._model_roles
            where = {r: k for k, r in enumerate(roles)}
            index, self._names = [], {}
            for e in ctx.entries:
                if e.info.layer is None:
                    index.append(_peerless_slot(e.info.name))
                    self._names.setdefault(index[-1], set()).add(e.info.name)
                else:
                    index.append(_PEERLESS + e.info.layer * len(roles) + where[role_of(e.info.name)])
            self._over = any(i >= _PEERLESS + self._capacity for i in index)
            self._roles = roles
            # 8 bits: the sums of h and h^2 stay exact in fp32 up to 256 ranks (a mismatch among
            # more may go unnoticed; the decision is still the same on every rank).
            self._hash = float(zlib.crc32("\n".join(roles).encode()) % 256 + 1) if roles else 0.0
            self._index = torch.tensor([_HEAD + (0 if self._over else i) for i in index], dtype=torch.long,
                                       device=ctx.device)
            head = [0.0] * _HEAD
            if roles:
                head[_LAYERED], head[_HASH], head[_ROLES] = 1.0, self._hash, float(len(roles))
                head[_HASH_SQ] = self._hash * self._hash
            head[_OVER] = 1.0 if self._over else 0.0
            self._head = torch.tensor(head + [0.0] * (self.width() - _HEAD), dtype=torch.float32, device=ctx.device)
            self._plan = (self._head, None if self._over else self._index)
            self._layout = layout
        return self._plan

    def _peerless_names(self, slot: int) -> str:
        names = sorted(getattr(self, "_names", {}).get(slot, ()))
        return " + ".join(names) if names else f"a tensor outside the layers (slot {slot}, on another rank)"

    def _warn_off(self, why: str) -> None:
        if not self._off_logged:
            log.warning("detectors.peers: %s; the peers detector stays off for this job", why)
            self._off_logged = True

    def _trace(self, step: int, ratios: Optional[np.ndarray], shares: np.ndarray) -> None:
        line: dict[str, Any] = {"step": step, "max_ratio": _nanmax(ratios), "max_share": _nanmax(shares)}
        if ratios is not None and np.isfinite(ratios).any():
            layer, role = np.unravel_index(np.nanargmax(ratios), ratios.shape)
            line["ratio_at"] = f"{self._roles[role] if role < len(self._roles) else role}@{layer}"
        if np.isfinite(shares).any():
            line["share_at"] = self._peerless_names(int(np.nanargmax(shares)))
        with open(os.environ[_TRACE], "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")


def _ratio_to_peers(squares: np.ndarray) -> np.ndarray:
    """``squares[layer, role]`` (world-wide squared norms) -> each tensor's norm relative to its
    own layer, ``q = norm / median norm of the layer's tensors``, divided by the median ``q`` of
    the same role in the other layers. NaN where there is nothing to judge (a zero or
    non-finite value). The layer's median, unlike its total, stays put when one of its tensors
    spikes, so the spike does not make the same layer's other tensors look small."""
    norms = np.sqrt(squares)
    q = norms / np.median(norms, axis=1, keepdims=True)
    ratios = np.full(q.shape, np.nan)
    for layer in range(q.shape[0]):
        median = np.median(np.delete(q, layer, axis=0), axis=0)
        ok = (median > 0) & np.isfinite(median) & np.isfinite(q[layer])
        ratios[layer, ok] = q[layer, ok] / median[ok]
    return ratios


def _nanmax(values: Optional[np.ndarray]) -> float:
    if values is None or not np.isfinite(values).any():
        return 0.0
    return float(np.nanmax(values))
