"""The detectors' section of the configuration (``detectors:``): one frozen dataclass per detector,
each field with its default, its bound and a docstring. ``megatron_patches.config`` re-exports every
name here and stays the one import to use; the split keeps each module to the package's size rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from . import config_checks as check
from .errors import ConfigError

@dataclass(frozen=True, kw_only=True)
class NonFiniteConfig:
    enabled: bool = True
    """Flag a step whose gradients hold NaN or Inf (counted separately per parameter)."""


@dataclass(frozen=True, kw_only=True)
class MagnitudeConfig:
    enabled: bool = True
    """Flag a step whose gradient norms exceed the thresholds below (each null = off)."""
    param_norm_max: Optional[float] = field(default=None, metadata={"check": check.positive})
    """Largest allowed L2 norm of one parameter's gradient."""
    total_norm_max: Optional[float] = field(default=1.0e6, metadata={"check": check.positive})
    """Largest allowed L2 norm of the whole model's gradient (before clipping)."""


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    enabled: bool = True
    """fp16 with a dynamic loss scaler: the steps it skips are its own business (calibration from
    the initial scale, a routine overflow), counted, not reported; a collapse or a run of skips
    after calibration is an incident (:mod:`megatron_patches.seams.loss_scale`). With a constant
    ``--loss-scale`` every overflow is an incident, whatever this says."""
    min_scale: float = field(default=1.0, metadata={"check": check.positive})
    """A skip with the loss scale at or below this value, or at the scaler's own floor
    (``--min-loss-scale``), is an incident (the scaler has collapsed), calibrating or not."""
    max_consecutive_skips: int = field(default=10, metadata={"check": check.at_least_one})
    """This many skipped steps in a row, counted once a step has succeeded in the process (the
    descent from the initial scale is not counted), is an incident."""


@dataclass(frozen=True, kw_only=True)
class HistoryConfig:
    enabled: bool = True
    """Judge gradient norms (each parameter, each layer, the total) against their own moving
    statistics: z-score outliers and sustained growth that are still finite."""
    ema_beta: float = field(default=0.98, metadata={"check": check.fraction})
    """Decay of the moving mean and variance of log(norm) per checked step (0.98: ~50 steps)."""
    warmup_steps: int = field(default=20, metadata={"check": check.at_least_one})
    """Accepted samples a series needs before it is judged (a restored baseline counts)."""
    zscore: float = field(default=8.0, metadata={"check": check.positive})
    """Flag a log-value more than this many standard deviations above its moving mean..."""
    min_ratio: float = field(default=16.0, metadata={"check": check.at_least_one})
    """...and a parameter's or a layer's share (its norm over the norm of the rest) more than
    this many times its baseline exp(mean) (1 = z-score alone)..."""
    total_min_ratio: float = field(default=20.0, metadata={"check": check.at_least_one})
    """...or the whole model's norm more than this many times its baseline."""
    drift_steps: int = field(default=8, metadata={"check": check.at_least_one})
    """Flag growth on this many consecutive checked steps..."""
    drift_ratio: float = field(default=1.2, metadata={"check": check.above_one})
    """...each by more than this factor over the last accepted norm."""
    per_param: bool = True
    """Also judge every parameter tensor (state on the device, 5 floats per tensor); false
    leaves the per-layer and total norms, which need no device work at all."""
    interval: int = field(default=1, metadata={"check": check.at_least_one})
    """Judge every N-th checked step only."""
    sample_fraction: float = field(default=1.0, metadata={"check": check.share})
    """Judge a rotating share of the parameter tensors per check (0.25: each one every 4th)."""


@dataclass(frozen=True, kw_only=True)
class ConsistencyConfig:
    enabled: bool = True
    """Compare data-parallel replicas bit-exactly each checked step (needs data parallelism;
    adds 20 floats to the one all-reduce, no collective of its own)."""
    target: Literal["auto", "grads", "params"] = "auto"
    """What the replicas must agree on. grads: reduced gradients (not with the distributed
    optimizer, whose gradients are sharded). params: the model parameters (an extra pass over
    them). auto: grads, or params with the distributed optimizer."""
    interval: int = field(default=1, metadata={"check": check.at_least_one})
    """Compare every N-th checked step only."""
    sample_fraction: float = field(default=0.0625, metadata={"check": check.share})
    """Checksum the bits of a rotating share of the tensors per check: the default, 1/16, reads
    1/16 of the gradient (or parameter) memory per check and covers every tensor in 16 checks.
    With grads the sum of squared norms still covers every tensor each check (the guard has
    those norms already); with params it covers the same rotating share. 1.0: every tensor on
    every check (one more full read)."""


@dataclass(frozen=True, kw_only=True)
class PeersConfig:
    enabled: bool = True
    """Judge each tensor's gradient against others of the same step: no history, so no warm-up
    (the first step of a job, or after a restart, is judged like any other)."""
    ratio: float = field(default=100.0, metadata={"check": check.above_one})
    """Flag a tensor inside a transformer layer whose norm relative to its layer (norm / the
    median norm of the layer's tensors) is more than this many times the median of that
    relative norm for the same tensor in the other layers."""
    share_max: float = field(default=30.0, metadata={"check": check.positive})
    """Flag a tensor outside the layers (embeddings, final norm, output layer: no peers) whose
    gradient norm is more than this many times the norm of the rest of the model."""
    max_slots: int = field(default=4096, metadata={"check": check.at_least_one})
    """Most floats for the layer tensors in the one all-reduce (32 more serve the others): the
    detector takes layers x tensors per layer of the whole model (agreed by the ranks at the first
    check), up to this many; a model that needs more leaves it off with one warning."""
    interval: int = field(default=1, metadata={"check": check.at_least_one})
    """Judge every N-th checked step only (the slots travel as zeros on the others)."""


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    enabled: bool = False
    """Fingerprint the weights each rank's optimizer steps and their Adam moments right after every
    update and again at the next check: a tensor changed in between was corrupted (any bit, no
    threshold), and the rank holding it is named. Off by default: two reads of the weights and
    moments per checked step (6 gradient read passes, each mixing the words it reads;
    docs/detectors.md, "audit")."""


@dataclass(frozen=True, kw_only=True)
class StateConfig:
    enabled: bool = True
    """Read a rotating slice of the weights each rank's optimizer steps and of their Adam moments
    per check (their largest magnitude, one fused read): a slice non-finite, or far above the same
    slice a full turn before, is an incident naming the parameter, the tensor (weight, exp_avg,
    exp_avg_sq) and the rank that holds it, found within 1/``fraction`` checked steps; snapshots and
    checkpoints are rollback targets only once a check after them read them in full
    (docs/detectors.md, "state")."""
    fraction: float = field(default=0.2, metadata={"check": check.share})
    """Share of every held tensor read per check (0.2: each element once in 5 checks, 0.2 of the
    held state's bytes per check; 1: all of it on every check)."""
    ratio: float = field(default=100.0, metadata={"check": check.above_one})
    """Flag a slice whose largest magnitude is more than this many times the same slice's at its
    previous check (this squared for exp_avg_sq, which holds squares of gradients)."""
    weight_ratio: float = field(default=10.0, metadata={"check": check.above_one})
    """The same for a slice of a weight (its main copy or shard under mixed precision or the
    distributed optimizer): a weight moves by about the learning rate per step, far less than its
    moments do, so one element x1000 that lifts its slice's largest magnitude more than 10-fold is
    found."""
    warmup_steps: int = field(default=20, metadata={"check": check.at_least_one})
    """Checks before a slice's largest magnitude becomes a baseline for the ratio (Adam's moments
    grow from zero, and the gradients with them, over the first steps); non-finite values are
    flagged from the first check."""


@dataclass(frozen=True, kw_only=True)
class PeakConfig:
    enabled: bool = False
    """Judge each gradient tensor's crest factor (its largest magnitude over its RMS) against the
    tensor's own history: a few elements gone far off while the norm barely moves (one element
    x1,000 lifts a 16k-element tensor's norm only 8x), and with several ranks the replica it came
    from. Off by default: one more read of every gradient per checked step (free on an Ascend part
    in saturation mode, which reads it anyway), one or two more before the reduction."""
    ema_beta: float = field(default=0.98, metadata={"check": check.fraction})
    """Decay of the moving mean and variance of log(crest factor) per checked step."""
    warmup_steps: int = field(default=20, metadata={"check": check.at_least_one})
    """Accepted samples a tensor needs before it is judged (a restored baseline counts)."""
    zscore: float = field(default=8.0, metadata={"check": check.positive})
    """Flag a log crest factor more than this many standard deviations above its moving mean..."""
    min_ratio: float = field(default=8.0, metadata={"check": check.at_least_one})
    """...and more than this many times its baseline exp(mean)."""


@dataclass(frozen=True, kw_only=True)
class ActivationsConfig:
    enabled: bool = False
    """Judge each watched module's output RMS and crest factor (largest magnitude over RMS) against
    its own history on checked steps: an activation gone far off while finite (x1,000, a flipped
    exponent bit), which the next layer norm hides from the gradients, and the rank it happened on.
    Off by default: one more read of every watched output per micro-batch of a checked step."""
    modules: tuple[str, ...] = field(default=("decoder.layers.*.self_attention", "decoder.layers.*.mlp"),
                                     metadata={"check": check.patterns})
    """fnmatch patterns on the global dotted module names whose outputs are watched."""
    ema_beta: float = field(default=0.9, metadata={"check": check.fraction})
    """Decay of the moving mean and variance of the log RMS and log crest factor per checked step
    (faster than history's: an output's RMS grows several-fold early in training, and a slow mean
    lags that trend, which widens the variance until a x1,000 falls inside it)."""
    warmup_steps: int = field(default=20, metadata={"check": check.at_least_one})
    """Accepted steps a module needs before it is judged (a restored baseline counts)."""
    zscore: float = field(default=8.0, metadata={"check": check.positive})
    """Flag a log RMS or log crest factor more than this many standard deviations above its mean..."""
    min_ratio: float = field(default=8.0, metadata={"check": check.at_least_one})
    """...and more than this many times its baseline exp(mean)."""


@dataclass(frozen=True, kw_only=True)
class TokensConfig:
    enabled: bool = True
    """Count the token ids each word embedding is fed outside its vocabulary (negative, or at least
    its row count), on the device, and hand it those ids as 0: a corrupted batch is an incident
    (kind ``vocab``) naming the rank that fed it, not a lookup that kills the process (one TP rank)
    or a zero vector nobody sees (tensor parallel). One compare over each micro-batch's ids, one
    float in the check's vector; no gradient read."""


@dataclass(frozen=True, kw_only=True)
class LossSpikeConfig:
    enabled: bool = True
    """Judge each checked step's training loss against the loss's own recent history: a loss more
    than ``factor`` times the median of the last ``window`` accepted losses, and more than
    ``zscore`` robust deviations (1.4826 x the median absolute deviation of their logarithms) above
    it, is an incident (kind ``loss_spike``), graded like any other. The loss is the value the
    training loop already reduces: no extra read of the gradients, no extra host read
    (docs/detectors.md, "loss_spike")."""
    factor: float = field(default=1.2, metadata={"check": check.above_one})
    """Flag a loss more than this many times its recent median (e.g. 1.5: 50 % above it)..."""
    zscore: float = field(default=8.0, metadata={"check": check.positive})
    """...and more than this many robust deviations of log(loss) above log(median): a run whose
    loss is noisy from step to step needs a larger jump than a steady one."""
    window: int = field(default=100, metadata={"check": check.at_least_one})
    """Accepted losses kept for the median (the most recent ones)."""
    warmup_steps: int = field(default=20, metadata={"check": check.at_least_one})
    """Accepted losses needed before a step is judged (a restored baseline counts); at most ``window``."""

    def __post_init__(self) -> None:
        if self.warmup_steps > self.window:
            raise ConfigError(f"`detectors.loss_spike.warmup_steps` must be <= `detectors.loss_spike.window` "
                              f"({self.window}), got {self.warmup_steps}: lower warmup_steps or raise window")


@dataclass(frozen=True, kw_only=True)
class DetectorsConfig:
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    """NaN/Inf check."""
    magnitude: MagnitudeConfig = field(default_factory=MagnitudeConfig)
    """Absolute gradient-norm thresholds."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss-scale health."""
    history: HistoryConfig = field(default_factory=HistoryConfig)
    """Gradient-norm statistics over time: z-score outliers and drift (docs/detectors.md)."""
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    """Cross-replica fingerprints: one data-parallel rank that disagrees (docs/detectors.md)."""
    peers: PeersConfig = field(default_factory=PeersConfig)
    """Each tensor against the same tensor in the other layers, from the first step (docs/detectors.md)."""
    audit: AuditConfig = field(default_factory=AuditConfig)
    """Held weights and optimizer state compared across the time between two updates (docs/detectors.md)."""
    state: StateConfig = field(default_factory=StateConfig)
    """A rotating slice of the held weights and optimizer state: non-finite or far off (docs/detectors.md)."""
    peak: PeakConfig = field(default_factory=PeakConfig)
    """Each gradient's largest magnitude over its RMS against its own history (docs/detectors.md)."""
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    """Each watched module's output against its own history (docs/detectors.md)."""
    tokens: TokensConfig = field(default_factory=TokensConfig)
    """Token ids outside the vocabulary, counted where they enter the model (docs/detectors.md)."""
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    """The training loss against its own recent median (docs/detectors.md)."""
