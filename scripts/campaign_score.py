"""The fault campaign's scoring (issue 55): pure functions of what the branches measured, apart
from running them (``scripts/fault_campaign.py``) and from the menu (``scripts/campaign_cells.py``).

Per cell (one fault, one seed), from branches of one clean warm-up:
- **harm** comes from the *unguarded twin* (the guard observing nothing, the drill fired): the cell
  is ``harmful`` when (a) a non-finite value is in the training state (weights, main weights, Adam
  moments) at any step after the fault, (b) at the end (``AFTER`` steps after the fault) the loss
  or the weights are further from the clean twin than a harmless perturbation takes them (the
  ``band``: the clean twin with every weight moved by one unit in the last place at the fault's
  step, measured per layout), or (c) the twin stopped (an exception, a hang, an exit code). It
  does not depend on any detector: the denominator is the same for every configuration.
- **detected**: the guarded branch recorded an incident at the fault's step or later;
  **localized** (strict): its first incident names exactly the faulted parameter (for a forward
  fault the faulted module, for an input fault the embedding the ids were fed to; never the
  parameter's module or layer) AND reports exactly the rank set the fault was bound to.
- **recovered**: the guarded branch finished with no non-finite value in its state and its state
  is bit-equal to the clean twin that skipped the same iterations and, where the guard rolled back
  and left samples out, was fed the same samples (``lr_factor: 1``); where the guard changed the
  learning rate, within the band of the clean twin instead.
- **false positives**: incidents in fault-free control runs (``false_positives_clean``), and,
  kept apart, incidents after a fault's detection window outside its episode.
"""

from __future__ import annotations

import math
from typing import Optional

import campaign_cells as cc


def reported_ranks(record: dict) -> list[int]:
    """The rank set an incident record reports: the consistency detector's suspects, else the
    origin ranks before the reduction (narrowed to the forward origin's ranks where those are a
    part of them), else the forward origin's ranks, else the rank of the parameter named first."""
    if record.get("suspected_ranks"):
        return sorted(record["suspected_ranks"])
    forward = set((record.get("forward_origin") or {}).get("ranks") or ())
    if forward and forward < set(record.get("origin_ranks") or ()):
        return sorted(forward)
    if record.get("origin_ranks"):
        return sorted(record["origin_ranks"])
    if record.get("forward_origin"):
        return sorted(record["forward_origin"]["ranks"])
    first = record.get("first") or {}
    return [first["ranks"]["global"]] if first.get("ranks") else []


def reported(record: dict) -> Optional[str]:
    """What a record names: the forward origin's module, else the parameter named first."""
    return (record.get("forward_origin") or {}).get("module") or (record.get("first") or {}).get("name")


def names_target(cell: cc.Cell, record: dict) -> bool:
    """Strict: the exact parameter; the exact module for a forward fault; for an input fault the
    embedding module or its weight (where the corrupted ids enter). A module or layer is not a name."""
    first_finding = record.get("first") or {}
    first = first_finding.get("name")
    module = (record.get("forward_origin") or {}).get("module")
    if cell.target == "forward":
        # The forward origin's module, or the activations detector's finding, which names the module
        # whose output it flagged (``activation:*`` reasons) where no forward origin was taken.
        by_activation = first == cc.MODULE and any(str(r).startswith("activation:")
                                                    for r in first_finding.get("reasons") or ())
        return module == cc.MODULE or (module is None and by_activation)
    if cell.target == "input":
        return module == cc.EMBEDDING or (module is None and first == f"{cc.EMBEDDING}.weight")
    return first == cc.PARAM and module in (None, cc.PARAM.rsplit(".", 1)[0])  # the name, its module besides


def localized(cell: cc.Cell, record: dict) -> bool:
    return reported_ranks(record) == [cell.rank()] and names_target(cell, record)


def band_of(nudged: list[dict]) -> dict:
    """The harmless band of a layout: the largest loss change and weight distance that moving every
    weight by one ulp made (``nudged``: those branches' measures against the clean twin)."""
    if not nudged:
        raise ValueError("the band needs at least one nudged branch")
    for m in nudged:
        if not m["finished"] or m["loss_delta"] is None or m["distance"] is None:
            raise ValueError(f"a nudged branch did not finish cleanly: {m}")
    return {"loss": max(m["loss_delta"] for m in nudged), "weight": max(m["distance"] for m in nudged),
            "runs": len(nudged)}


def harm(unguarded: dict, band: dict) -> tuple[dict, bool]:
    """The ``harm`` figures of a cell and its verdict, from its unguarded twin's measure."""
    figures = {"loss_delta": unguarded["loss_delta"], "weight_distance": unguarded["distance"],
               "band": {"loss": band["loss"], "weight": band["weight"]},
               "nonfinite": unguarded["nonfinite_max"], "stopped": unguarded["stopped"]}
    beyond = [(value is None or not math.isfinite(value) or value > limit)
              for value, limit in ((unguarded["loss_delta"], band["loss"]), (unguarded["distance"], band["weight"]))]
    harmful = bool(unguarded["nonfinite_max"] > 0 or unguarded["stopped"] or any(beyond))
    return figures, harmful


def recovered(measure: dict, band: dict) -> tuple[bool, str]:
    """Whether a guarded branch ended whole, and on what basis."""
    if measure["stopped"] or not measure["finished"]:
        return False, f"stopped: {measure['stopped'] or 'did not finish'}"
    if measure["nonfinite_end"]:
        return False, f"{measure['nonfinite_end']} non-finite values left in the state"
    if not measure["lr_factor_one"]:
        near = (measure["twin_distance"] is not None and measure["twin_distance"] <= band["weight"]
                and measure["twin_loss_delta"] is not None and measure["twin_loss_delta"] <= band["loss"])
        return near, "within the band of the clean twin" if near else "outside the band of the clean twin"
    if measure["twin_equal"]:
        return True, "bit-equal to the clean twin of the same iterations and samples"
    return False, "differs from the clean twin of the same iterations and samples"


def episode(window: list[dict], incidents: list[dict]) -> set[int]:
    """The steps of a detected fault's own episode: its window's incidents and each flagged step
    right after them (a lasting fault is skipped, then rolled back on the next step)."""
    steps, flagged = {r["step"] for r in window}, {r["step"] for r in incidents}
    while steps and max(steps) + 1 in flagged:
        steps.add(max(steps) + 1)
    return steps


def score(cell: cc.Cell, measure: dict, band: dict) -> dict:
    """One configuration's scores of ``cell`` from its guarded branch's measure."""
    incidents = [r for r in measure["incidents"] if r["step"] >= cc.FAULT_STEP]
    first = min(incidents, key=lambda r: r["step"]) if incidents else None
    window = [r for r in incidents if r["step"] <= cc.FAULT_STEP + cc.DETECT]
    own = episode(window, incidents)
    ok, basis = recovered(measure, band)
    row = {"detected": first is not None, "localized": first is not None and localized(cell, first),
           "steps_to_detect": None if first is None else first["step"] - cc.FAULT_STEP,
           "false_positives": sum(r["step"] > cc.FAULT_STEP + cc.DETECT and r["step"] not in own for r in incidents),
           "recovered": ok, "recovery": basis, "skipped": measure["skipped"]}
    if first is not None:
        row.update(reported=reported(first), reported_ranks=reported_ranks(first), incident_kind=first.get("kind"))
    return row


def totals(rows: list[dict], controls: list[dict]) -> dict:
    """Per layout and configuration: the harmful cells (one set for every configuration), what was
    detected, strictly localized and recovered of them, the misses by name, alarms on harmless
    cells, and the false positives of the fault-free controls (per 10,000 clean steps)."""
    out: dict = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        harmful = [r for r in mine if r["harmful"]]
        for config in cc.CONFIGS:
            clean = [c for c in controls if c["layout"] == layout and c["config"] == config]
            steps = sum(c["steps"] for c in clean)
            alarms = sum(c["incidents"] for c in clean)
            out[f"{layout}/{config}"] = {
                "cells": len(mine), "harmful": len(harmful), "harmless": len(mine) - len(harmful),
                "detected": sum(r[config]["detected"] for r in harmful),
                "localized": sum(r[config]["localized"] for r in harmful),
                "recovered": sum(r[config]["recovered"] for r in harmful),
                "alarms_on_harmless": sum(r[config]["detected"] for r in mine if not r["harmful"]),
                "false_positives_after_fault": sum(r[config]["false_positives"] for r in mine),
                "false_positives_clean": alarms, "clean_runs": len(clean), "clean_steps": steps,
                "false_positives_per_10k_clean_steps": round(alarms * 1e4 / steps, 2) if steps else None,
                "misses": [r["key"] for r in harmful if not r[config]["localized"]],
            }
    return out
