"""The fault campaign's menu, schedule and strict scoring (issue 40), apart from running it
(``scripts/fault_campaign.py``). A cell is one fault kind x scope x target x layout; its score
comes from the incident records of the run that carried it.

Strict scoring, per cell:
- **detected**: an incident on the fault's step or the ``DETECT`` steps after it (a weight or an
  optimizer state corrupted before the update shows in the next step's gradients);
- **localized**: the first such incident reports exactly the expected rank set (the consistency
  detector's suspects, else the origin ranks before the reduction, narrowed to the forward
  origin's ranks where those are a part of them, else the forward origin's ranks, else the rank
  of the parameter named first) AND names the target: the parameter named
  first is the corrupted one, or the forward origin is the module holding it (weight and state
  targets) or the drilled module (forward target), or, for a forward target, the parameter named
  first is in the drilled module's layer;
- **false positives**: incidents on the control steps after the detection window, other than those
  continuing the detected fault's own episode (a lasting fault is skipped, then rolled back on the
  next step);
- **recovered**: the cell's last control step trained with a finite loss (the run went on);
- **steps to detect**: the first incident's step minus the fault's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

PARAM = "decoder.layers.1.mlp.linear_fc1.weight"
MODULE = "decoder.layers.1.mlp"
EMBEDDING = "embedding.word_embeddings"
"""The input target's module: the token ids it is fed are the batch's."""
LAYER = 1
WARMUP = 24  # history's 20-step warm-up and a margin; the first checkpoint (rollback target) is the step before
GAP = 6  # a fault every GAP steps: its step, DETECT steps to be found, the rest clean controls
DETECT = 2
SAVE_INTERVAL = 2 * GAP  # a checkpoint before every other fault: a rollback replays at most 2 GAP steps
SEED = 1234

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
TARGETS = {  # label -> drill keys; {param} is filled per layout (:func:`param_of`)
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
_EP2 = ("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2", "--disable-bias-linear",
        "--bf16", "--use-distributed-optimizer")
_CP2 = ("--context-parallel-size", "2", "--bf16", "--use-distributed-optimizer")
LAYOUTS = {  # label -> (ranks, harness flags, rank a local/forward drill binds to, rank a grad/weight/state drill binds to)
    "1rank": (1, ("--precision", "bf16"), 0, 0),
    "dp2": (2, ("--precision", "bf16", "--distributed-optimizer"), 1, 0),
    "1rank+full": (1, ("--precision", "bf16"), 0, 0),
    "dp2+full": (2, ("--precision", "bf16", "--distributed-optimizer"), 1, 0),
    # Tensor parallel: each rank holds half of fc1's rows (its own, unreduced gradient); the module's
    # output is the same on both after fc2's all-reduce, so a forward drill makes rank 1's differ.
    "tp2": (2, ("--precision", "bf16", "--tp", "2"), 1, 1),
    # Pipeline parallel: layer 1 and its fc1 live on the second stage, rank 1.
    "pp2": (2, ("--precision", "bf16", "--pp", "2"), 1, 1),
    "tp2+full": (2, ("--precision", "bf16", "--tp", "2"), 1, 1),
    "pp2+full": (2, ("--precision", "bf16", "--pp", "2"), 1, 1),
    # Megatron-LM's packaged loop (megatron-core 0.17+, Python 3.12; :data:`LOOP`), its flags.
    # Two expert ranks: 4 experts, rank 1 holds experts 2 and 3 and their whole optimizer state
    # (expert data parallelism 1), so every fault of an expert weight is bound to rank 1; the dense
    # weights and the tokens are data parallel over both ranks.
    "ep2": (2, _EP2, 1, 1),
    "ep2+full": (2, _EP2, 1, 1),
    # Two context-parallel ranks, each with half of every sequence; the distributed optimizer's
    # shard of rank 0 holds fc1 (the drill's refusal names it), so grad, weight and state faults bind there.
    "cp2": (2, _CP2, 1, 0),
    "cp2+full": (2, _CP2, 1, 0),
}
LOOP = ("ep2", "ep2+full", "cp2", "cp2+full")
"""Layouts run through Megatron-LM's own loop (``megatron.training``, shipped by megatron-core 0.17+)
rather than the tiny-GPT harness, which has no experts and no context parallelism."""
EXPERT_PARAM = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
"""EP2's target parameter: on rank 1, local expert 0 is expert 2 of layer 1's MoE."""
QUICK_LAYOUTS = ("1rank", "dp2", "dp2+full")
"""The quick mode's layouts; there a ``+full`` layout carries the lasting targets only (its other
cells are the same trainings as without the opt-in detectors, bar their reads)."""
FULL_DETECTORS = {"audit": {"enabled": True}, "peak": {"enabled": True}, "activations": {"enabled": True}}
"""What a ``+full`` layout adds to the guard's defaults: the three detectors that are off by default
for what they read (the state audit, gradient peaks, activations)."""


INPUT_RANK = {"pp2": 0, "pp2+full": 0}
"""Where an input fault is bound when not to the layout's own rank: under PP2 the embedding is on
the first stage."""


def kinds_of(target: str) -> dict:
    """The menu of kinds for ``target``: :data:`INPUT_KINDS` for the token ids, else :data:`KINDS`."""
    return INPUT_KINDS if target == "input" else KINDS


def param_of(layout: str) -> str:
    """The parameter a layout's gradient, weight and state faults go into."""
    return EXPERT_PARAM if layout.startswith("ep2") else PARAM


def full(layout: str) -> bool:
    """Whether ``layout`` runs with every detector on (:data:`FULL_DETECTORS`)."""
    return layout.endswith("+full")
SHARD_HOLDER = 0
"""Under DP2 with the distributed optimizer rank 0's shard holds all of PARAM (tests/test_drill_holders.py):
grad, weight and state drills are bound to it; local and forward drills to rank 1 (a replica's own card)."""
assert LAYOUTS["dp2"][3] == SHARD_HOLDER
QUICK_SCOPE = {"scale:x2": "all", "scale:x1000": "all", "noise:1%": "all"}
"""Quick mode: one scope per kind, element unless named here."""

_ALL = SCOPES
_PARTIAL = ("element", "row", "1pct", "10pct")
_ULP = ("changes each value by one unit in the last place (2^-23 of it in the fp32 gradients, weights and "
        "states; 2^-8 in a bf16 output), no more than the rounding of the bf16 computation that produced "
        "it: no statistic or bound can tell it from rounding noise")
_SPREAD = ("multiplies the covered gradient values by at most 2 (x0.5 to x2): inside the natural spread "
           "of gradient norms (clean runs reach 12x a tensor's baseline share and 8.8x the total, "
           "docs/detectors.md), so a threshold that caught it would flag clean steps; no replica holds "
           "the same reduced values to compare with (one rank; the distributed optimizer's shard)")
_NOISE_GRAD = ("moves each value by about 1 % of itself; a minibatch gradient's elements vary far more "
               "than that from batch to batch, and no replica holds the same reduced values to compare with")
_ADAM_BOUND = ("Adam's update stays within about lr per element whatever the scale of its momentum: "
               "the changed update is one a gradient history of that size would give")
_DRAW_DROP = ("with seed 1234 the three bits drawn for the one element are 3 and 5 (low mantissa) and 28, an "
              "exponent bit set in every value between 2^-31 and 2, so the element is divided by 2^32: it drops "
              "to about zero.")
_SIGN_GRAD = ("keeps every magnitude the detectors read (norms are sign-blind), and direction is no tell either: "
              "single elements change sign from batch to batch, and a clean step's whole gradient of this tensor "
              "points against its Adam momentum on about half of the updates (69 % of 129 clean bf16 updates here, "
              "cosine -0.46 to 0.44; 51 % on real text, -0.85 to 0.86; tests/test_campaign.py), so a reversed one "
              "is what a clean step looks like; and no replica holds ")

VALID_IDS = ("every id the fault changed stayed inside the vocabulary (the drill's own count when it fired, "
             "\"0 outside the vocabulary\"): the batch became other valid tokens, which the model reads as it "
             "reads any text; only the data's source (a checksum of the shard) can tell a wrong token from a "
             "right one, not the numbers the guard sees")
"""Why an input cell is undetectable by design, where its fault left every id a valid one: decided
per cell from what the drill did (a low bit, 1 % noise or x2 of a small id often stays inside),
never from what the guard saw."""

REASONS = {  # (kind, target) -> (scopes, why a cell is undetectable by design)
    **{("bitflip:mantissa_low", t): (_ALL, _ULP) for t in TARGETS},
    ("noise:1%", "local"): (_ALL, _NOISE_GRAD),
    ("noise:1%", "grad"): (_ALL, _NOISE_GRAD),
    ("noise:1%", "param"): (_ALL, "moves each weight by about 1 % of itself (about 2e-4 here), less than one Adam "
                                  "update moves it (lr 3e-3 per element): the same change an ordinary step makes"),
    ("noise:1%", "exp_avg"): (_ALL, "changes the next update by about 1 % of itself, " + _ADAM_BOUND),
    ("noise:1%", "exp_avg_sq"): (_ALL, "changes the next update by about 0.5 % of itself, " + _ADAM_BOUND),
    ("noise:1%", "forward"): (_ALL, "1 % noise on an activation is below its variation between batches, and "
                                    "nothing holds what an activation should be to compare with"),
    ("scale:x2", "local"): (_ALL, _SPREAD),
    ("scale:x2", "grad"): (_ALL, _SPREAD),
    ("scale:x2", "forward"): (_ALL, "the next layer norm takes most of a x2 out; the gradients behind it move "
                                    "by at most 2x, " + _SPREAD.split(": ", 1)[1]),
    ("bitflip:mantissa_high", "local"): (_ALL, _SPREAD),
    ("bitflip:mantissa_high", "grad"): (_ALL, _SPREAD),
    ("scale:x2", "exp_avg"): (_ALL, "doubles the next update of the covered elements; " + _ADAM_BOUND),
    ("bitflip:mantissa_high", "exp_avg"): (_ALL, "moves the next update by at most x1.5; " + _ADAM_BOUND),
    ("scale:x2", "exp_avg_sq"): (_ALL, "shrinks the next update by 1.4x, a smaller step: " + _ADAM_BOUND),
    ("bitflip:mantissa_high", "exp_avg_sq"): (_ALL, "moves the next update by at most 1.4x; " + _ADAM_BOUND),
    ("scale:x1000", "exp_avg_sq"): (_ALL, "shrinks the next update by 32x: a smaller step is what a quiet gradient "
                                          "history gives, and no magnitude check can call a small step wrong"),
    ("bitflip:exponent_high", "exp_avg_sq"): (_ALL, "multiplies a second moment (about 1e-6 here, exponent high bit "
                                                    "clear) by 2^128, which shrinks the next update of the element "
                                                    "to nothing: a smaller step, as scale x1000 of exp_avg_sq"),
    ("bitflip:mantissa_high", "forward"): (_ALL, "moves the covered activations by at most x1.5; the next layer norm "
                                                 "takes most of it out and the gradients behind it move less than "
                                                 "their natural spread"),
    **{("bitflip:bits=3", t): (("element",), _DRAW_DROP + " " + tail) for t, tail in (
        ("local", "A gradient element near zero is an ordinary value, and the tensor's norm barely moves."),
        ("grad", "A gradient element near zero is an ordinary value, and the tensor's norm barely moves."),
        ("exp_avg", "A momentum near zero gives a smaller step for that element: " + _ADAM_BOUND))},
    ("bitflip:bits=3", "forward"): (("element",), "with seed 1234 the three bits drawn for the one bf16 element "
                                                  "are 1, 3 and 5, all mantissa: the activation moves by at most a "
                                                  "third, as mantissa_high does"),
    ("sign", "forward"): (("element", "row", "1pct", "10pct"),
                          "a negated activation (or one token's row) is a value the layer gives other inputs, and "
                          "negating a random 1 % or 10 % of an output changes none of its statistics: its values lie "
                          "evenly about zero (layer 1's MLP output over 150 bf16 steps: mean within 1.6 % of the RMS, "
                          "48 % to 51 % positive), so magnitude and shape (RMS, crest factor, the activations "
                          "detector's pair) stay; the per-channel means over the tokens shrink by 2 % or 20 % "
                          "without turning, while they change by x0.45 to x2.4 from one micro-batch to the next "
                          "(tests/test_campaign.py); nothing holds what the output should be"),
    ("sign", "local"): (_ALL, _SIGN_GRAD + "the same values before the reduction (each replica's micro-batches differ)"),
    ("sign", "grad"): (_ALL, _SIGN_GRAD + "the same reduced values (one rank; the shard)"),
    ("sign", "exp_avg"): (_PARTIAL, "reverses the next update of the covered elements at the same size; "
                                    + _ADAM_BOUND),
}


@dataclass(frozen=True)
class Cell:
    kind: str
    scope: str
    target: str
    layout: str

    @property
    def key(self) -> str:
        return f"{self.layout}/{self.target}/{self.scope}/{self.kind}"

    def rank(self) -> int:
        """The rank the drill is bound to, which is also the rank set a strict score expects."""
        _, _, own, holder = LAYOUTS[self.layout]
        if self.target == "input":
            return INPUT_RANK.get(self.layout, own)
        return own if self.target in ("local", "forward") else holder

    def spec(self, step: int) -> str:
        kind, extra = kinds_of(self.target)[self.kind]
        keys = [f"step={step}", TARGETS[self.target].format(param=param_of(self.layout)), f"rank={self.rank()}",
                f"scope={self.scope}", f"seed={SEED}", extra]
        return f"{kind}:" + ",".join(k for k in keys if k)

    def reason(self) -> Optional[str]:
        if full(self.layout) and self.target in LASTING:
            return None  # the audit compares every bit of the held state: none of these is undetectable
        scopes, why = REASONS.get((self.kind, self.target), ((), None))
        return why if self.scope in scopes else None


def cells(quick: bool = False, layouts: Optional[tuple] = None, targets: Optional[tuple] = None) -> list[Cell]:
    """Every cell of the menu (quick: one scope per kind, the lasting targets only where ``+full``),
    ordered layout, target, scope, kind; ``layouts`` default: all (quick: :data:`QUICK_LAYOUTS`);
    ``targets`` default: all."""
    found = []
    for layout in layouts or (QUICK_LAYOUTS if quick else tuple(LAYOUTS)):
        for target in targets or TARGETS:
            if quick and full(layout) and target not in LASTING:
                continue
            for scope in SCOPES:
                for kind in kinds_of(target):
                    if quick and scope != QUICK_SCOPE.get(kind, "element"):
                        continue
                    found.append(Cell(kind, scope, target, layout))
    return found


def fault_step(index: int) -> int:
    """The step of a run's ``index``-th fault (every other one two steps after a checkpoint)."""
    return WARMUP + 1 + index * GAP


def reported_ranks(record: dict) -> list[int]:
    if record.get("suspected_ranks"):
        return sorted(record["suspected_ranks"])
    forward = set((record.get("forward_origin") or {}).get("ranks") or ())
    if forward and forward < set(record.get("origin_ranks") or ()):
        # An expert-parallel all-to-all carries a forward fault to every member of the group within
        # the step: the gradients name the whole group, the rerun's forward origin the rank it entered.
        return sorted(forward)
    if record.get("origin_ranks"):
        return sorted(record["origin_ranks"])
    if record.get("forward_origin"):
        return sorted(record["forward_origin"]["ranks"])
    first = record.get("first") or {}
    return [first["ranks"]["global"]] if first.get("ranks") else []


def names_target(cell: Cell, record: dict) -> bool:
    first = (record.get("first") or {}).get("name")
    origin = (record.get("forward_origin") or {}).get("module")
    if cell.target == "forward":
        return origin == MODULE or (record.get("first") or {}).get("layer") == LAYER and origin is None
    if cell.target == "input":
        return first == f"{EMBEDDING}.weight"
    param = param_of(cell.layout)
    return first == param or origin == param.rsplit(".", 1)[0]


def episode(window: list[dict], incidents: list[dict]) -> set[int]:
    """The steps of the detected fault's own episode: those of the incidents in its detection window
    and each flagged step right after them (a fault that lasts is skipped, then rolled back on the
    next step)."""
    steps, flagged = {r["step"] for r in window}, {r["step"] for r in incidents}
    while steps and max(steps) + 1 in flagged:
        steps.add(max(steps) + 1)
    return steps


def reason_of(cell: Cell, outside: Optional[int]) -> Optional[str]:
    """Why ``cell`` is undetectable by design, or None; ``outside`` as for :func:`score`."""
    return VALID_IDS if cell.target == "input" and outside == 0 else cell.reason()


def score(cell: Cell, step: int, incidents: list[dict], losses: dict, finished: bool,
          outside: Optional[int] = None) -> dict:
    """One cell's scores from its run's incident records and last loss per step; ``outside``: for an
    input cell, how many ids its fault left outside the vocabulary (its drill's line): none makes the
    cell undetectable by design (:data:`VALID_IDS`)."""
    window = [r for r in incidents if step <= r["step"] <= step + DETECT]
    first = min(window, key=lambda r: r["step"]) if window else None
    controls = [r for r in incidents if step + DETECT < r["step"] < step + GAP
                and r["step"] not in episode(window, incidents)]
    last_control = step + GAP - 1
    loss = losses.get(last_control)
    row = {**asdict(cell), "key": cell.key, "step": step, "spec": cell.spec(step), "rank": cell.rank(),
           "detected": first is not None, "localized": False, "steps_to_detect": None,
           "false_positives": len(controls), "recovered": finished and loss is not None,
           "reason": reason_of(cell, outside)}
    if cell.target == "input":
        row["outside"] = outside
    if first is not None:
        row["steps_to_detect"] = first["step"] - step
        row["reported_ranks"] = reported_ranks(first)
        row["reported"] = (first.get("forward_origin") or {}).get("module") or (first.get("first") or {}).get("name")
        row["incident_kind"] = first["kind"]
        row["localized"] = row["reported_ranks"] == [cell.rank()] and names_target(cell, first)
    return row


def totals(rows: list[dict]) -> dict:
    """Per layout: cells, detected, strictly localized, false positives, recovered, and how the
    cells split into detectable (no reason written) and undetectable by design."""
    out = {}
    for layout in sorted({r["layout"] for r in rows}):
        mine = [r for r in rows if r["layout"] == layout]
        detectable = [r for r in mine if not r["reason"]]
        out[layout] = {
            "cells": len(mine), "detected": sum(r["detected"] for r in mine),
            "localized": sum(r["localized"] for r in mine),
            "false_positives": sum(r["false_positives"] for r in mine),
            "recovered": sum(r["recovered"] for r in mine),
            "detectable": len(detectable), "detectable_detected": sum(r["detected"] for r in detectable),
            "detectable_localized": sum(r["localized"] for r in detectable),
            "by_design": len(mine) - len(detectable),
        }
    return out
