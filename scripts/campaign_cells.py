"""The fault campaign's menu (issues 40 and 55), apart from running and scoring it
(``scripts/fault_campaign.py`` runs it, ``scripts/campaign_score.py`` scores it). A cell is one
fault: kind x scope x target x layout x seed (the seed draws the elements, bits and noise).
"""

from __future__ import annotations

from dataclasses import dataclass

PARAM = "decoder.layers.1.mlp.linear_fc1.weight"
MODULE = "decoder.layers.1.mlp"
EMBEDDING = "embedding.word_embeddings"
"""The input target's module: the token ids it is fed are the batch's."""
WARMUP = 24
"""The clean warm-up every branch starts from (the history detector's 20-step warm-up and a margin)."""
FAULT_STEP = WARMUP + 2
"""Every fault is injected at the second step of its branch: the first, clean, gives the detectors
that compare a step with the one before (the state audit fingerprints after each update) what a
continuous run gives them."""
AFTER = 20
"""K: steps trained after the fault step; harm and recovery are read at step FAULT_STEP + AFTER."""
END = FAULT_STEP + AFTER
DETECT = 2
"""Incidents up to DETECT steps after the fault (and the episode they start) are the fault's; later
ones are false positives after it."""
SEEDS = (1234, 1235, 1236)
"""Three element draws per cell."""

KINDS = {  # label -> (drill kind, extra keys)
    "nan": ("nan", ""),
    "inf": ("inf", ""),
    "bitflip:exponent_high": ("bitflip", "bit=exponent_high"),
    "bitflip:mantissa_high": ("bitflip", "bit=mantissa_high"),
    "bitflip:mantissa_low": ("bitflip", "bit=mantissa_low"),
    "bitflip:bits=3": ("bitflip", "bits=3"),
    "sign": ("sign", ""),
    "scale:x2": ("scale", "factor=2"),
    "scale:x1000": ("scale", "factor=1000"),
    "noise:1%": ("noise", "factor=0.01"),
}
INPUT_KINDS = {  # the input target's menu: token ids are integers (no NaN, Inf, exponent or mantissa)
    "bitflip:bit=0": ("bitflip", "bit=0"),
    "bitflip:bit=30": ("bitflip", "bit=30"),
    "bitflip:bit=63": ("bitflip", "bit=63"),
    "bitflip:bits=3": ("bitflip", "bits=3"),
    "sign": ("sign", ""),
    "scale:x2": ("scale", "factor=2"),
    "scale:x1000": ("scale", "factor=1000"),
    "noise:1%": ("noise", "factor=0.01"),
}
SCOPES = ("element", "row", "1pct", "10pct", "all")
TARGETS = {  # label -> drill keys
    "local": "phase=local,param={param}",
    "grad": "phase=grad,param={param}",
    "param": "phase=param,param={param}",
    "exp_avg": "phase=state,slot=exp_avg,param={param}",
    "exp_avg_sq": "phase=state,slot=exp_avg_sq,param={param}",
    "forward": f"phase=forward,module={MODULE}",
    "input": f"phase=input,module={EMBEDDING}",
}
LASTING = ("param", "exp_avg", "exp_avg_sq")
"""Targets whose fault stays (in the weights, the optimizer state) until a rollback removes it."""
LAYOUTS = {  # label -> (ranks, harness flags, rank a local/forward drill binds to, rank a grad/weight/state drill binds to)
    "1rank": (1, ("--precision", "bf16"), 0, 0),
    # DP2 with the distributed optimizer: rank 0's shard holds all of PARAM (tests/trainings/test_drill_holders.py).
    "dp2": (2, ("--precision", "bf16", "--distributed-optimizer"), 1, 0),
    # Tensor parallel: each rank holds half of fc1's rows (its own, unreduced gradient); the module's
    # output is the same on both after fc2's all-reduce, so a forward drill makes rank 1's differ.
    "tp2": (2, ("--precision", "bf16", "--tp", "2"), 1, 1),
    # Pipeline parallel: layer 1 and its fc1 live on the second stage, rank 1.
    "pp2": (2, ("--precision", "bf16", "--pp", "2"), 1, 1),
}
"""The harness layouts. EP2 and CP2 (Megatron-LM's own loop, Python 3.12) are not yet branched from
a snapshot: the loop has no hook for it (docs/reliability.md says they are not measured under these rules)."""
CONFIGS = ("defaults", "full")
"""What each cell is scored with: the guard's defaults, and every detector on (``+full``)."""
FULL_DETECTORS = {"audit": {"enabled": True}, "peak": {"enabled": True}, "activations": {"enabled": True}}
"""What ``full`` adds to the defaults: the three detectors that are off by default for what they read."""
INPUT_RANK = {"pp2": 0}
"""Where an input fault is bound when not to the layout's own rank: under PP2 the embedding is on
the first stage."""
QUICK = (("1rank", "grad", "element", "nan"), ("1rank", "param", "element", "nan"), ("1rank", "exp_avg_sq", "element", "inf"),
         ("1rank", "param", "all", "bitflip:mantissa_low"), ("dp2", "exp_avg", "all", "scale:x1000"),
         ("dp2", "exp_avg_sq", "all", "inf"))
"""The CI campaign's cells (layout, target, scope, kind), one seed each: faults that harm (a NaN
gradient: a skipped step; a NaN weight: a rollback; an Inf second moment, issue 55's two DP2 cells: rank 0's momentum x1000 and its second
moment set to Inf) and one that should not (one ulp of every weight of the parameter)."""


def kinds_of(target: str) -> dict:
    """The menu of kinds for ``target``: :data:`INPUT_KINDS` for the token ids, else :data:`KINDS`."""
    return INPUT_KINDS if target == "input" else KINDS


@dataclass(frozen=True)
class Cell:
    kind: str
    scope: str
    target: str
    layout: str
    seed: int = SEEDS[0]

    @property
    def key(self) -> str:
        return f"{self.layout}/{self.target}/{self.scope}/{self.kind}/{self.seed}"

    def rank(self) -> int:
        """The rank the drill is bound to, which is also the rank set a strict score expects."""
        _, _, own, holder = LAYOUTS[self.layout]
        if self.target == "input":
            return INPUT_RANK.get(self.layout, own)
        return own if self.target in ("local", "forward") else holder

    def spec(self) -> str:
        kind, extra = kinds_of(self.target)[self.kind]
        keys = [f"step={FAULT_STEP}", TARGETS[self.target].format(param=PARAM), f"rank={self.rank()}",
                f"scope={self.scope}", f"seed={self.seed}", extra]
        return f"{kind}:" + ",".join(k for k in keys if k)


def cells(layouts: tuple = ("1rank",), targets: tuple = (), seeds: tuple = SEEDS, quick: bool = False) -> list[Cell]:
    """Every cell of the menu for ``layouts`` (``targets`` default: all; ``seeds``: the draws),
    ordered layout, target, scope, kind, seed; ``quick``: :data:`QUICK`, one seed."""
    if quick:
        return [Cell(kind, scope, target, layout) for layout, target, scope, kind in QUICK]
    return [Cell(kind, scope, target, layout, seed) for layout in layouts for target in targets or TARGETS
            for scope in SCOPES for kind in kinds_of(target) for seed in seeds]
