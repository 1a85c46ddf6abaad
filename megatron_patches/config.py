"""The YAML configuration: frozen, keyword-only dataclasses with one docstring per field.

``load_config(path)`` reads a file, ``Config.from_dict(data)`` a mapping. Unknown keys and
wrong types are errors that name the key path and list what is allowed; nothing is dropped
silently. Every field has a default, so an empty file (or no file) is a working setup.

This module is the reference a user reads: each field, its default and its bound. Finding,
reading and validating the file against these types lives in ``config_load``, which does not
import this module (so ``Config.from_dict`` can call its ``build`` without a cycle); its public
names are re-exported here, and ``megatron_patches.config`` stays the one import to use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from . import config_checks as check
from .config_detectors import (ActivationsConfig, AuditConfig, ConsistencyConfig, DetectorsConfig, HistoryConfig,
                               LossScaleConfig, LossSpikeConfig, MagnitudeConfig, NonFiniteConfig, PeakConfig,
                               PeersConfig, StateConfig, TokensConfig)
from .config_load import ENV_VAR, build, config_path, read_config_file, redact_url, redacted
from .errors import ConfigError

__all__ = [
    "ENV_VAR", "ActivationsConfig", "AlertsConfig", "AuditConfig", "Config", "ConsistencyConfig", "DetectorsConfig",
    "HistoryConfig", "LossScaleConfig", "LossSpikeConfig", "MagnitudeConfig", "NonFiniteConfig", "PeakConfig",
    "PeersConfig", "RecoveryConfig", "ResponseConfig", "SceneConfig", "StateConfig", "TokensConfig", "WebhookConfig",
    "config_path",
    "load_config", "read_config_file", "redact_url", "redacted",
]


@dataclass(frozen=True, kw_only=True)
class WebhookConfig:
    url: str = field(default="", metadata={"check": check.http_url, "secret": True})
    """Where alerts are POSTed as JSON (required; it often holds a token, so it is never logged)."""
    format: Literal["generic", "slack", "feishu", "dingtalk"] = "generic"
    """Body shape. generic: the incident record itself. slack: {"text": ...}. feishu:
    {"msg_type": "text", "content": {"text": ...}}. dingtalk: {"msgtype": "text", "text": {"content": ...}}."""
    timeout_s: float = field(default=5.0, metadata={"check": check.positive})
    """Give up on one POST after this many seconds."""
    retries: int = field(default=2, metadata={"check": check.non_negative})
    """Further attempts after a failed POST, with doubling pauses (alerts.backoff_s first)."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ConfigError("every entry of `alerts.webhooks` needs a `url`, e.g. url: https://hooks.example/...")


@dataclass(frozen=True, kw_only=True)
class AlertsConfig:
    min_severity: Literal["error", "critical"] = "error"
    """Incidents at or above this severity go to the sinks below; all others are only logged."""
    jsonl: Optional[str] = None
    """Append each alert to this JSONL file (relative paths are taken under report_dir)."""
    command: Optional[str] = None
    """Shell command run once per alert with the incident JSON on stdin, e.g. "mail -s nan ops"."""
    command_timeout_s: float = field(default=30.0, metadata={"check": check.positive})
    """Kill the command (and its process group) after this many seconds."""
    command_retries: int = field(default=0, metadata={"check": check.non_negative})
    """Further runs after the command failed or timed out."""
    webhooks: tuple[WebhookConfig, ...] = ()
    """HTTP endpoints to POST each alert to."""
    queue_size: int = field(default=100, metadata={"check": check.at_least_one})
    """Alerts waiting for the sender thread; when full the oldest is dropped and counted."""
    backoff_s: float = field(default=1.0, metadata={"check": check.positive})
    """Pause before the first retry of a sink; doubled for each further retry."""


@dataclass(frozen=True, kw_only=True)
class ExitCodesConfig:
    rollback: int = field(default=84, metadata={"check": check.exit_status})
    """Every rank exits with this after the ledger is written: restart the job, it resumes from
    the newest healthy checkpoint (``megatron-patches launch --restart-on`` must match)."""
    stop: int = field(default=85, metadata={"check": check.exit_status})
    """An *error* with ``response.on_error: stop``: stopped cleanly for a person to look."""
    critical: int = field(default=86, metadata={"check": check.exit_status})
    """A *critical* incident (several replicas at once, or the retry budget spent). Give it the
    code your launcher's or scheduler's policy does not restart (NVRx ft_launcher 0.4.1 restarts
    on any failure, measured: docs/megatron_lm.md)."""
    peer_lost: int = field(default=87, metadata={"check": check.exit_status})
    """A peer died or went silent while the ranks agreed on an incident: restart like a lost node."""
    fence: int = field(default=88, metadata={"check": check.exit_status})
    """A device had ``response.hardware_repeat`` hardware-class incidents in the job: one line names
    the host and device, the ledger's ``fenced`` holds them; restart the job without that node
    (``scripts/slurm/guarded.sbatch`` requeues excluding it)."""

    def __post_init__(self) -> None:
        codes = [self.rollback, self.stop, self.critical, self.peer_lost, self.fence]
        if len(set(codes)) != len(codes):
            raise ConfigError(f"response.exit_codes: each outcome needs its own code, got rollback {self.rollback}, "
                              f"stop {self.stop}, critical {self.critical}, peer_lost {self.peer_lost}, "
                              f"fence {self.fence}")


@dataclass(frozen=True, kw_only=True)
class ResponseConfig:
    persist_steps: int = field(default=2, metadata={"check": check.at_least_one})
    """An anomaly on this many consecutive checked steps is an *error* (one alone is a *warning*)."""
    recur_count: int = field(default=3, metadata={"check": check.at_least_one})
    """This many incidents within ``recur_window`` steps is an *error* too."""
    recur_window: int = field(default=100, metadata={"check": check.at_least_one})
    """Steps over which ``recur_count`` is counted."""
    on_error: Literal["rollback", "stop"] = "rollback"
    """What an *error* does after saving: roll back to the newest healthy checkpoint, or stop
    every rank cleanly (``exit_codes.stop``, 85) for a person to look."""
    critical_origins: int = field(default=2, metadata={"check": check.at_least_one})
    """Anomalies entering on this many data-parallel replicas at once are *critical* (one rank's
    NaN copied to every replica by the all-reduce counts as one origin)."""
    origin_check: bool = True
    """Flag non-finite local gradients before the data-parallel reduction, to tell a fault's
    origin rank from the replicas it spread to (one extra read of the gradient buffers)."""
    replay: bool = True
    """Where the training loop offers it, re-run the step's forward/backward to tell
    deterministic faults (data, numerics) from transient ones (hardware)."""
    peer_timeout_s: float = field(default=300.0, metadata={"check": check.positive})
    """Longest any rank waits for the others in an incident's decision (the findings gathered
    to rank 0, the decision broadcast back). When a peer died or stopped answering, every rank
    still alive exits with ``exit_codes.peer_lost`` (87) within this time instead of waiting for
    the process group's own timeout (Megatron's default: 10 minutes, then an abort)."""
    hardware_repeat: int = field(default=2, metadata={"check": check.at_least_one})
    """Hardware-class incidents (``cause.class: hardware``: a device's held state went bad with clean
    gradients, replicas disagree, or a replay on the same rank is clean) that fence a device: the
    n-th on one host and device in one job (the ledger counts across restarts) ends every rank with
    ``exit_codes.fence`` and a line naming the host and device to exclude."""
    exit_codes: ExitCodesConfig = field(default_factory=ExitCodesConfig)
    """The process exit status of each way the guard ends a job, for the launcher to act on.
    Refusals at start (a bad config, ledger, drill or variant) always exit 2."""


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    mode: Literal["in_process", "restart"] = "in_process"
    """How Megatron-LM's loop rolls back. in_process: every rank restores the newest certified
    in-memory snapshot in the same processes and redoes the iterations since; where that cannot
    be (no certified snapshot newer than the newest healthy checkpoint, a safe-mode feature that
    rebuilds the model, a data iterator the guard cannot record), it says why in one line and
    restarts. restart: every rank exits with ``response.exit_codes.rollback`` and the launcher
    restarts the job from the newest healthy checkpoint. The harness picks with ``--recovery``."""
    snapshot_interval: int = field(default=5, metadata={"check": check.at_least_one})
    """In-process mode: copy each rank's own state (model, optimizer, scheduler, RNG, data
    position) to host memory after every N-th iteration."""
    snapshots_kept: int = field(default=2, metadata={"check": check.at_least_one})
    """In-process mode: snapshots held per rank (host memory: this many copies of the rank's
    parameters and optimizer state; the start line says the most any rank may hold)."""
    certify_steps: int = field(default=1, metadata={"check": check.at_least_one})
    """A snapshot or a Megatron-LM checkpoint becomes a rollback target after this many further
    checked steps came out clean (the first of them checks the gradients of its own parameters
    and, with the consistency detector, that the replicas agree on them); a flagged step before
    that drops the snapshot and marks the checkpoint not certified. With ``detectors.state`` on,
    the first of them also reads all of the weights and optimizer state the target holds."""
    lr_factor: float = field(default=0.5, metadata={"check": check.share})
    """Each rollback multiplies the learning rate by this (1: a rollback that changes nothing but
    the iterations redone)."""
    lr_floor: float = field(default=0.05, metadata={"check": check.share})
    """The learning-rate scale never drops below this fraction of the original."""
    max_rollbacks: int = field(default=3, metadata={"check": check.at_least_one})
    """Retry budget: one more *error* after this many rollbacks is *critical*."""
    blacklist: Literal["always", "deterministic"] = "always"
    """Which samples a rollback skips, for an incident whose cause is data or unknown (a hardware,
    numerics or software cause blacklists none): the batches of the incident steps (always), or only
    those a replay reproduced the fault on (deterministic)."""
    keep_checkpoints: Optional[int] = field(default=None, metadata={"check": check.at_least_one})
    """The harness's retention: checkpoints it keeps (None: 3); the newest healthy one is never
    deleted. Megatron-LM's loop keeps every checkpoint it saves and the guard deletes none there,
    so a Megatron-LM job that sets this key is refused at start (one line, exit 2)."""
    disable_features: tuple[str, ...] = field(default=(), metadata={"check": check.known_features})
    """Features switched off in the job that resumes after a rollback (safe mode on retry): names
    from :data:`megatron_patches.safe_mode.FEATURES` (``dropout``, ``overlap_grad_reduce``, ...) or a
    group (``fusions``, ``overlap``). Megatron-LM's loop sets their arguments before it builds the
    model; the harness knows ``dropout`` only (the others are not in its model)."""
    disable_on_further_rollbacks: tuple[tuple[str, ...], ...] = field(
        default=(), metadata={"check": check.known_feature_stages})
    """Safe mode that grows with the retries: the k-th list is switched off as well from the job's
    (k+1)-th rollback on, e.g. ``[[fusions], [overlap]]``: the second rollback adds the fusions,
    the third the overlap. Names as in ``disable_features``; empty: nothing more after the first."""


@dataclass(frozen=True, kw_only=True)
class SceneConfig:
    enabled: bool = True
    """Save a fault-scene bundle per incident under ``<report_dir>/scenes/``."""
    max_bytes: int = field(default=64 * 2**20, metadata={"check": check.at_least_one})
    """Per rank and incident; the batch tokens are dropped first when over."""
    queue_size: int = field(default=4, metadata={"check": check.at_least_one})
    """Bundles waiting for the writer thread; more are dropped and counted."""
    min_severity: Literal["warning", "error", "critical"] = "warning"
    """Incidents below this severity get no bundle."""


@dataclass(frozen=True, kw_only=True)
class Config:
    enabled: bool = True
    """Master switch: false installs nothing."""
    check_interval: int = field(default=1, metadata={"check": check.at_least_one})
    """Check every N-th optimizer step (1 = every step)."""
    serve_norm: bool = False
    """Hand Megatron's ``get_grad_norm`` the total norm of the guard's own checked pass instead of
    letting Megatron compute it again: one read of the gradients, one all-reduce and one host read
    fewer per checked step. The guard sums in another order than Megatron, so the norm differs in
    the last bits, and bf16 training amplifies that: guard on and guard off drift apart (6.5e-5
    relative in the loss within 40 steps, DP2 bf16). Off (the default): Megatron computes its own
    norm and a guarded run equals an unguarded one bit for bit. Even when on, Megatron computes
    its own norm with bf16 main gradients (its kernel sums them otherwise) and under Megatron-FSDP
    (its optimizer computes the norm and clips in one call)."""
    report_dir: str = "megatron_patches_reports"
    """Directory for incidents.jsonl and fault scenes (relative paths are taken from the cwd)."""
    overflow_mode: Literal["auto", "ieee", "saturation"] = "auto"
    """How the accelerator reports overflow. ieee: Inf/NaN appear (GPUs, newer Ascend parts).
    saturation: overflow clamps to +-max and NaN becomes 0 (older Ascend training parts), so
    |x| >= finfo(dtype).max counts as overflow. auto: ask torch_npu where present, else ieee."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    """Which checks run before clipping."""
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    """Where error and critical incidents are sent besides the log (file, command, webhooks)."""
    response: ResponseConfig = field(default_factory=ResponseConfig)
    """How incidents are graded into warning / error / critical and what each does."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """The rollback protocol: learning-rate scaling, sample blacklist, retry budget."""
    scene: SceneConfig = field(default_factory=SceneConfig)
    """Fault-scene bundles."""
    grad_history: bool = True
    """Rank 0 appends total and per-layer gradient norms of every checked step to
    ``<report_dir>/grad_history.jsonl`` (read by ``megatron-patches report --plot``)."""
    grad_history_max_lines: int = field(default=100_000, metadata={"check": check.at_least_one})
    """Rotate grad_history.jsonl to grad_history.jsonl.1 after this many lines (bounds disk use)."""
    inject: tuple[str, ...] = ()
    """Fault-injection specs for drills, e.g. "nan:step=5,param=*linear_fc1.weight" (the spec:
    docs/contributing.md, "Fault injection")."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Level of this package's log messages."""

    @classmethod
    def from_dict(cls, data: Optional[dict]) -> "Config":
        """Build and validate a Config from a mapping (e.g. parsed YAML)."""
        return build(cls, {} if data is None else data)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some top-level fields changed (validated like the YAML)."""
        merged = {**dataclasses.asdict(self), **changes}
        return Config.from_dict(merged)


def load_config(path: Optional[str] = None) -> Config:
    """Load the config at ``path``, or at $MEGATRON_PATCHES_CONFIG, or the defaults."""
    path = config_path(path)
    return Config() if path is None else Config.from_dict(read_config_file(path))
