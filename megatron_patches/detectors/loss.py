"""The training loss against its own recent history (kind ``loss_spike``).

The loss is the one number every training loop already reduces over the data-parallel replicas.
It reaches the guard in one of two ways, and neither adds a pass over the gradients or a host read:

- **a host float** (:meth:`LossSpike.feed`): a loop that reduces the step's loss to a Python float
  before ``optimizer.step()`` hands it over (the tiny-GPT harness, :mod:`megatron_patches.testing.trainer`);
- **the schedule's loss tensors** (:meth:`LossSpike.feed_tensors`): Megatron-LM's ``train_step`` reads
  its loss on the host only at log intervals, after the update. The seam takes the per-micro-batch
  loss tensors the forward-backward schedule returned (:mod:`megatron_patches.seams.megatron_lm`),
  and :meth:`LossSpike.local` adds this rank's (sum, count) to the check's one all-reduced vector:
  two floats on the device, summed over the job with the check's own collective and read with its
  one host read. Tensor-parallel copies of the last stage's loss add the same pair each, so the
  quotient is the job's loss; stages without a loss add zeros.

The judgement, on the host and alike on every rank (:class:`Baseline`): in log space, the median
of the last ``window`` accepted losses and their median absolute deviation (MAD). A loss is a spike
when it is more than ``factor`` times the median *and* more than ``zscore`` robust deviations
(1.4826 x MAD) above it: the factor is the smallest jump that counts in a steady run, the deviations
keep a run whose loss swings from step to step from firing on its own noise. No verdict before
``warmup_steps`` losses. Every checked step's loss joins the window, a flagged one too: one spike
moves a median of ``window`` values by one rank at most, while a lasting change of level (a new
data mix) becomes the median within ``window / 2`` steps instead of being flagged forever. A
replay's loss does not join (its step was counted already). Non-finite and non-positive losses are
neither judged nor kept (non-finite gradients are the NaN/Inf check's). The window travels in
checkpoints (``state_dict``), so a restart judges its first step.

The loss says *that* a step went wrong, not where: the incident names what the other signals say
(gradients, held state, the ranks' own losses, gathered on the slow path), and says so when none
of them points anywhere.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Any, Iterable, Optional

import torch

from ..collectives import all_gather_floats
from .base import CheckContext, Detector

_MAD_TO_SD = 1.4826
"""The MAD of a normal sample times this is its standard deviation."""
_MIN_SD = 1e-3
"""Floor on the robust deviation of log(loss): a loss steady to 0.1 % is not infinitely sure."""
_KEY = "lm loss"
"""The loss Megatron's GPT loss functions report (the first key of the dict where it is absent)."""


class Baseline:
    """The last ``window`` accepted losses (their logarithms) and the judgement against them."""

    def __init__(self, cfg: Any, logs: Iterable[float] = ()):
        self.cfg = cfg
        self.logs: deque = deque(logs, maxlen=cfg.window)

    @property
    def warm(self) -> bool:
        return len(self.logs) >= self.cfg.warmup_steps

    def judge(self, loss: float) -> Optional[dict]:
        """``{"spike", "ratio", "z", "median", "sd"}`` for ``loss``, or None where it is not judged
        (not warm, non-finite or non-positive)."""
        if not self.warm or not math.isfinite(loss) or loss <= 0:
            return None
        logs = list(self.logs)
        centre = median(logs)
        sd = max(_MAD_TO_SD * median([abs(x - centre) for x in logs]), _MIN_SD)
        rise = math.log(loss) - centre
        spike = rise > math.log(self.cfg.factor) and rise / sd > self.cfg.zscore
        return {"spike": spike, "ratio": math.exp(rise), "z": rise / sd, "median": math.exp(centre), "sd": sd}

    def add(self, loss: float) -> None:
        """A step's loss joins the window (non-finite and non-positive ones do not)."""
        if math.isfinite(loss) and loss > 0:
            self.logs.append(math.log(loss))


class LossSpike(Detector):
    """A checked step's loss far above its recent median (kind ``loss_spike``)."""

    name = "loss_spike"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.baseline = Baseline(cfg)
        self._value: Optional[float] = None  # the step's loss, a host float, where fed so
        self._local: Optional[float] = None  # this rank's own loss, where the loop knows it
        self._tensors: Optional[list] = None  # this rank's per-micro-batch loss tensors, where fed so
        self._loss = math.nan  # the loss judged at this check
        self._judged: Optional[dict] = None
        self._ranks: Optional[list] = None  # every rank's own loss, gathered on the slow path

    # --- what the training loop feeds ------------------------------------------------

    def feed(self, loss: float, local: Optional[float] = None) -> None:
        """The step's loss, reduced over the job (the same on every rank), before its check;
        ``local``: this rank's own share, where the loop knows it (named in an incident)."""
        self._value, self._local, self._tensors = float(loss), local, None

    def feed_tensors(self, losses: list) -> None:
        """This rank's loss dicts as a forward-backward schedule returns them (one per micro-batch,
        each value a tensor: (sum, count) or a micro-batch mean), before the step's check; an
        empty list on a stage without a loss."""
        self._value, self._local, self._tensors = None, None, list(losses)

    # --- fast path -------------------------------------------------------------------

    def width(self) -> int:
        return 2  # (loss sum, count) of the fed tensors; zeros where the loss came as a float

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        pair = _pair(self._tensors)
        if pair is not None:
            out.copy_(pair.to(out.device))

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        if self._value is not None:
            loss = self._value
        elif len(reduced) == 2 and reduced[1] > 0:
            loss = reduced[0] / reduced[1]
        else:
            loss = math.nan
        self._loss, self._judged, self._ranks = loss, self.baseline.judge(loss), None
        return ["loss_spike"] if self._judged is not None and self._judged["spike"] else []

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        if not ctx.replay:  # skipped or not: the median shrugs off a spike, and absorbs a lasting shift
            self.baseline.add(self._loss)
        self._value = self._local = self._tensors = None
        self._loss, self._judged = math.nan, None

    # --- slow path -------------------------------------------------------------------

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        """Every rank's own loss to every rank (one small all-gather, on the slow path only; every
        rank of a flagged step is here): rank 0 puts them in the record. Names no parameter."""
        if self._judged is not None and self._judged["spike"]:
            mine = self._local if self._local is not None else _own(self._tensors)
            every = all_gather_floats([math.nan if mine is None else mine], ctx.device)
            self._ranks = [row[0] for row in every]
        return {}

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        judged = self._judged
        if judged is None or not judged["spike"]:
            return {}
        cfg = self.cfg
        field: dict[str, Any] = {
            "loss": self._loss, "median": judged["median"], "ratio": round(judged["ratio"], 4),
            "z": round(judged["z"], 2), "robust_sd_log": judged["sd"], "baseline_steps": len(self.baseline.logs),
            "factor": cfg.factor, "zscore": cfg.zscore, "window": cfg.window,
            "why": (f"loss {self._loss:.5g} is {judged['ratio']:.3g}x its median {judged['median']:.5g} over the "
                    f"last {len(self.baseline.logs)} accepted steps ({judged['z']:.1f} robust deviations)")}
        if self._ranks is not None:
            field["rank_losses"] = {rank: value for rank, value in enumerate(self._ranks) if math.isfinite(value)}
            field["ranks_above"] = above_the_others(field["rank_losses"], cfg.factor)
        return {"loss_spike": field}

    # --- state -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"logs": list(self.baseline.logs)}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.baseline = Baseline(self.cfg, state.get("logs", ()))


def feed_loss(detectors: list, loss: Any, local: Optional[float] = None) -> None:
    """Hand the current step's loss, before ``optimizer.step()``, to the run's loss-spike detector
    among ``detectors`` (the guard's ``detectors``; nothing where it is off): a host float the loop
    has already reduced over the job (``local``: this rank's own loss), or a list of this rank's loss
    dicts as the forward-backward schedule returned them (:meth:`LossSpike.feed_tensors`)."""
    for detector in detectors:
        if isinstance(detector, LossSpike):
            if isinstance(loss, (list, tuple)):
                detector.feed_tensors(list(loss))
            else:
                detector.feed(loss, local)


def above_the_others(losses: dict, factor: float) -> list:
    """The ranks whose own loss is more than ``factor`` times the median of the ranks' losses (where
    they differ: with several data-parallel replicas): where a batch or a replica alone went off."""
    values = [v for v in losses.values() if v > 0]
    if len(set(values)) < 2:
        return []
    centre = median(values)
    return sorted(rank for rank, value in losses.items() if value > factor * centre)


def _pair(losses: Optional[list]) -> Optional[torch.Tensor]:
    """(sum, count) of the fed loss tensors as one float32 tensor of two, or None without any. A few
    kernels whatever the number of micro-batches (a stack, a sum; a fill and a stack for means), as
    Megatron-LM's own reduction of the same tensors after the update; no copy from the host."""
    if not losses or not isinstance(losses[0], dict) or not losses[0]:
        return None
    key = _KEY if _KEY in losses[0] else next(iter(losses[0]))
    values = [d.get(key) for d in losses]
    if not all(torch.is_tensor(v) for v in values) or values[0].numel() not in (1, 2) \
            or any(v.shape != values[0].shape for v in values):
        return None  # not a loss this detector knows how to read: nothing judged
    rows = torch.stack(values).detach().reshape(len(values), -1).float()
    if rows.shape[1] == 2:  # (sum, count) per micro-batch
        return rows.sum(dim=0)
    return torch.stack((rows.sum(), torch.full_like(rows[0, 0], float(len(values)))))  # a mean per micro-batch


def _own(losses: Optional[list]) -> Optional[float]:
    """This rank's own loss from its fed tensors (a host read: the slow path only)."""
    pair = _pair(losses)
    if pair is None:
        return None
    total, count = pair.tolist()
    return total / count if count > 0 else None


def fed_schedule(schedule: Any, detectors: Iterable) -> Any:
    """``schedule`` (a loop's forward-backward function) handing the loss tensors it returns to the
    guard before the update: Megatron-LM reads its loss on the host only at log intervals, after the
    update, so the check takes it from the schedule. A forward-only call (a replay) feeds nothing."""
    def forward_backward(*args, **kwargs):
        losses = schedule(*args, **kwargs)
        if not kwargs.get("forward_only", False):
            feed_loss(detectors, list(losses or ()))
        return losses
    return forward_backward
