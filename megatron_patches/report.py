"""Read ``incidents.jsonl`` and ``grad_history.jsonl`` back and explain them to a person.

Reading is forgiving: an empty or missing file, a half-written last line (the job died
mid-write), a line that is not JSON or one with another schema each become a *problem*
naming file and line, and every readable record is still used. ``megatron-patches report``
(:mod:`megatron_patches.cli`) is the command-line face of this module. The text of one
incident comes from :mod:`megatron_patches.incident_text`, which the alert sinks use too
(during training, without this offline reader).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import incident_text
from .errors import UserError
from .incident_text import ranks_of, text_of
from .incidents import HISTORY_FILE, HISTORY_SCHEMA, INCIDENT_SCHEMA, INCIDENTS_FILE

diagnosis = incident_text.diagnosis  # kept importable from here
headline = incident_text.headline

SEVERITY_COLORS = {"warning": "tab:orange", "error": "tab:red", "critical": "darkred"}


@dataclass
class Problem:
    """Something in a report file that could not be used; ``line`` is 1-based, 0 = whole file."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}" if self.line else f"{self.path}: {self.message}"


@dataclass
class Report:
    directory: str
    incidents: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def read_jsonl(path: str, schema: str, problems: list[Problem]) -> list[dict[str, Any]]:
    """Every record of ``schema`` in ``path``; anything unusable is appended to ``problems``."""
    if not os.path.exists(path):
        problems.append(Problem(path, 0, "does not exist (nothing was recorded yet, or report_dir points elsewhere)"))
        return []
    records: list[dict[str, Any]] = []
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "not a regular file"
        problems.append(Problem(path, 0, f"is {what}, not incident records; move it away (the writer needs a file there)"))
        return []
    try:
        with open(path, "rb") as handle:
            lines = handle.readlines()
    except OSError as exc:
        problems.append(Problem(path, 0, f"cannot be read ({exc.strerror or exc}); check its permissions"))
        return []
    if not any(line.strip() for line in lines):
        problems.append(Problem(path, 0, "is empty: nothing recorded"))
        return []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if number == len(lines) and not raw.endswith(b"\n"):
                why = "truncated last line (the writer stopped mid-line, e.g. the job was killed)"
            elif isinstance(exc, json.JSONDecodeError):
                why = f"not a JSON line ({exc.msg} at column {exc.colno})"
            else:
                why = "not UTF-8 text"
            problems.append(Problem(path, number, why + "; skipped"))
            continue
        if not isinstance(record, dict):
            problems.append(Problem(path, number, f"expected a JSON object, got {type(record).__name__}; skipped"))
            continue
        found = record.get("schema")
        if found != schema:
            problems.append(Problem(
                path, number,
                f"schema {found!r} is not {schema!r}; skipped (read it with the megatron_patches that wrote it)",
            ))
            continue
        records.append(record)
    return records


def load_report(directory: str, with_history: bool = False) -> Report:
    """Read a report directory; raises UserError only when the directory itself is unusable."""
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise UserError(f"report directory {directory!r} {what}; pass the report_dir of a run")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise UserError(f"report directory {directory!r} is not readable by this user")
    report = Report(directory)
    report.incidents = read_jsonl(os.path.join(directory, INCIDENTS_FILE), INCIDENT_SCHEMA, report.problems)
    _merge_rollback_outcomes(report.incidents, report.problems)
    if with_history:
        report.history = read_jsonl(os.path.join(directory, HISTORY_FILE), HISTORY_SCHEMA, report.problems)
    return report


def _merge_rollback_outcomes(incidents: list[dict], problems: list[Problem]) -> None:
    """An exit-and-restart rollback's outcome is known only to the restart, which writes it in the
    ledger the record names (``ledger``): merged into the record as read, never into the file.
    Adds ``rolled_back_to`` (the iteration resumed from), ``lr_scale``, ``iterations_skipped``,
    ``restart`` (this rollback's number), ``restarts_used`` (the ledger's count) and
    ``disabled_features`` (safe mode of the resumed job), or ``rollback_pending`` when no restart
    has resumed yet."""
    ledgers: dict[str, Any] = {}
    for rec in incidents:
        path = rec.get("ledger")
        if not isinstance(path, str) or rec.get("action") != "rollback" or isinstance(rec.get("rolled_back_to"), int):
            continue
        if path not in ledgers:
            ledgers[path] = _read_ledger(path, problems)
        ledger = ledgers[path]
        if ledger is not None:
            rec.update(_outcome_of(ledger, rec.get("step")))


def _read_ledger(path: str, problems: list[Problem]) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            ledger = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        problems.append(Problem(path, 0, f"the rollback ledger cannot be read ({exc}); outcomes not shown"))
        return None
    if not isinstance(ledger, dict) or not isinstance(ledger.get("events"), list):
        problems.append(Problem(path, 0, "not a megatron_patches ledger; outcomes not shown"))
        return None
    return ledger


def _outcome_of(ledger: dict, step: Any) -> dict[str, Any]:
    """The exit event of the rollback at ``step`` and the restart that resumed after it."""
    events = [e for e in ledger["events"] if isinstance(e, dict)]
    exits = [i for i, e in enumerate(events) if "exit" in e]
    mine = next((i for i in exits if events[i].get("step") == step), None)
    if mine is None:
        return {}
    resumed = next((e for e in events[mine + 1:] if "resumed_from" in e), None)
    outcome: dict[str, Any] = {"restart": exits.index(mine) + 1, "restarts_used": ledger.get("rollbacks"),
                               "iterations_skipped": events[mine].get("skip_iterations", [])}
    if resumed is None:
        return {**outcome, "rollback_pending": True}
    resumed_with = {"rolled_back_to": resumed["resumed_from"], "lr_scale": resumed.get("lr_scale")}
    if resumed.get("disabled_features"):
        resumed_with["disabled_features"] = resumed["disabled_features"]
    return {**outcome, **resumed_with}


# --- text -------------------------------------------------------------------------------


def table_rows(incidents: list[dict]) -> list[list[str]]:
    header = ["step", "severity", "kind", "first parameter", "layer", "tp/pp/dp", "rank", "host", "action", "replay",
              "resumed from"]
    rows = [header]
    for rec in incidents:
        first = rec.get("first") if isinstance(rec.get("first"), dict) else None
        ranks = ranks_of(first)
        replay = rec.get("replay") if isinstance(rec.get("replay"), dict) else {}
        rows.append([
            text_of(rec.get("step")), text_of(rec.get("severity")), text_of(rec.get("kind")),
            text_of((first or {}).get("name")), text_of((first or {}).get("layer")),
            "/".join(text_of(ranks.get(k)) for k in ("tp", "pp", "dp")) if ranks else "-",
            text_of(ranks.get("global")), text_of((first or {}).get("host")),
            text_of(rec.get("action")), text_of(replay.get("verdict")),
            "pending" if rec.get("rollback_pending") else text_of(rec.get("rolled_back_to")),
        ])
    return rows


def format_table(incidents: list[dict]) -> str:
    rows = table_rows(incidents)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


CAUSE_ORDER = ("software", "hardware", "data", "numerics", "unknown")
"""The order the verdict weighs cause classes in: what ends a job for a person to act on comes first."""


def cause_of(rec: dict) -> tuple[str, list[str]]:
    """(cause class, devices as ``host device``) of a record; a record without ``cause`` (written
    before it existed) is ``unknown``. The devices are the cause's own (hardware), else where the
    fault was named first."""
    cause = rec.get("cause") if isinstance(rec.get("cause"), dict) else {}
    klass = cause.get("class") if cause.get("class") in CAUSE_ORDER else "unknown"
    devices = [f"{text_of(d.get('host'))} {text_of(d.get('device'))}" for d in cause.get("devices") or []
               if isinstance(d, dict)]
    first = rec.get("first") if isinstance(rec.get("first"), dict) else None
    if not devices and first is not None and first.get("host") is not None:
        devices = [f"{text_of(first.get('host'))} {text_of(first.get('device'))}"]
    return klass, devices or ["-"]


def groups(incidents: list[dict]) -> list[dict[str, Any]]:
    """Incidents grouped by cause class and device: ``{"cause", "device", "count", "steps"}``, in the
    verdict's order of classes, then by count."""
    found: dict[tuple[str, str], list] = {}
    for rec in incidents:
        klass, devices = cause_of(rec)
        for device in devices:
            found.setdefault((klass, device), []).append(rec.get("step"))
    rows = [{"cause": k, "device": d, "count": len(steps), "steps": steps} for (k, d), steps in found.items()]
    return sorted(rows, key=lambda g: (CAUSE_ORDER.index(g["cause"]), -g["count"], g["device"]))


def verdict(incidents: list[dict]) -> str:
    """The report's first line: what happened to the run, and what to do, in one line."""
    if not incidents:
        return "verdict: no incidents"
    fenced = [r for r in incidents if r.get("action") == "fence"]
    if fenced:
        _, devices = cause_of(fenced[-1])
        hardware = [g for g in groups(incidents) if g["cause"] == "hardware" and g["device"] == devices[0]]
        count = hardware[0]["count"] if hardware else 1
        return (f"verdict: hardware: device {devices[0]} fenced after {count} hardware-class incident(s); "
                f"restart the job without host {devices[0].split(' ', 1)[0]}")
    by_class = Counter(cause_of(r)[0] for r in incidents)
    if by_class["software"]:
        return (f"verdict: software: a fault on every replica from the first checked step ({by_class['software']} "
                "incident(s)); fix the code or setup, a restart meets it again")
    top = min(by_class, key=lambda k: (-by_class[k], CAUSE_ORDER.index(k)))
    rest = ", ".join(f"{k} {by_class[k]}" for k in CAUSE_ORDER if by_class[k] and k != top)
    line = f"verdict: {len(incidents)} incident(s), most of them {top} ({by_class[top]})" + (f"; {rest}" if rest else "")
    hardware = [g for g in groups(incidents) if g["cause"] == "hardware" and g["device"] != "-"]
    if hardware:
        line += f"; hardware most on {hardware[0]['device']} ({hardware[0]['count']})"
    last = incidents[-1]
    if last.get("action") in ("stop", "fence") or last.get("severity") == "critical":
        line += f"; the run stopped at step {text_of(last.get('step'))}"
    return line


def format_groups(incidents: list[dict]) -> str:
    rows = [["cause", "device", "incidents", "steps"]] + [
        [g["cause"], g["device"], str(g["count"]), ", ".join(text_of(s) for s in g["steps"])] for g in groups(incidents)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_text(report: Report) -> str:
    if not report.incidents:
        return f"{verdict([])}\nno incidents in {report.directory}"
    blocks = [verdict(report.incidents), "", "by cause and device:", format_groups(report.incidents), "",
              format_table(report.incidents), ""]
    for rec in report.incidents:
        blocks.extend(diagnosis(rec) + [""])
    blocks.append(_counts_line(report.incidents))
    return "\n".join(blocks)


def _counts_line(incidents: list[dict]) -> str:
    by_sev = Counter(str(r.get("severity")) for r in incidents)
    parts = ", ".join(f"{by_sev[s]} {s}" for s in ("critical", "error", "warning") if by_sev[s])
    return f"{len(incidents)} incident(s): {parts}" if parts else f"{len(incidents)} incident(s)"


def summary(report: Report) -> dict[str, Any]:
    """The machine-readable form printed by ``report --json``."""
    return {
        "directory": report.directory,
        "verdict": verdict(report.incidents),
        "groups": groups(report.incidents),
        "counts": {
            "total": len(report.incidents),
            "severity": dict(Counter(str(r.get("severity")) for r in report.incidents)),
            "kind": dict(Counter(str(r.get("kind")) for r in report.incidents)),
            "action": dict(Counter(str(r.get("action")) for r in report.incidents)),
            "cause": dict(Counter(cause_of(r)[0] for r in report.incidents)),
        },
        "incidents": report.incidents,
        "problems": [{"file": p.path, "line": p.line, "message": p.message} for p in report.problems],
    }


# --- plot -------------------------------------------------------------------------------


def _layer_order(keys: list[str]) -> list[str]:
    """Embeddings first, then numbered layers in order, then everything else as first seen."""
    embed = [k for k in keys if "embed" in k.lower()]
    numbered = sorted((k for k in keys if k.lstrip("-").isdigit()), key=int)
    rest = [k for k in keys if k not in embed and k not in numbered]
    return embed + numbered + rest


def _edges(steps: list[int]) -> list[float]:
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return [2 * steps[0] - mids[0]] + mids + [2 * steps[-1] - mids[-1]]


def _layer_grid(by_step: dict, steps: list[int], layers: list[str]):
    """(norms, non-finite marks): layers x steps arrays, NaN where a cell has nothing to show."""
    import numpy as np

    grid = np.full((max(len(layers), 1), len(steps)), np.nan)
    bad = np.full(grid.shape, np.nan)
    for j, step in enumerate(steps):
        values = by_step[step].get("layers") or {}
        for i, name in enumerate(layers):
            v = values.get(name, 0)
            if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
                grid[i, j] = v
            elif v is None:
                bad[i, j] = 1.0
    return grid, bad


def _plot_totals(ax, by_step: dict, steps: list[int]) -> None:
    """The total norm on a log axis; non-finite totals as red crosses along the top."""
    totals = [(s, by_step[s].get("total_norm")) for s in steps]
    good = [(s, v) for s, v in totals if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if good:
        ax.plot([s for s, _ in good], [v for _, v in good], color="black", linewidth=1)
        ax.set_yscale("log")
    nonfinite = [s for s, v in totals if v is None]
    if nonfinite:
        ax.plot(nonfinite, [1] * len(nonfinite), "rx", transform=ax.get_xaxis_transform(),
                label="non-finite total norm", clip_on=False)
        ax.legend(loc="upper left", fontsize="small")
    ax.set_ylabel("total norm")
    ax.set_xlabel("step")


def plot(report: Report, out_path: str) -> None:
    """Per-layer gradient-norm heatmap (log colours) and the total norm, incidents marked."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'megatron_patches[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.patches import Patch

    rows = [h for h in report.history if isinstance(h.get("step"), int) and isinstance(h.get("layers", {}), dict)]
    if not rows:
        raise UserError(f"--plot needs step records in {os.path.join(report.directory, HISTORY_FILE)}; found none")
    by_step = {h["step"]: h for h in rows}
    steps = sorted(by_step)
    seen: dict[str, None] = {}
    for h in rows:
        seen.update(dict.fromkeys(str(k) for k in (h.get("layers") or {})))
    layers = _layer_order(list(seen))
    grid, bad = _layer_grid(by_step, steps, layers)

    fig, (ax_heat, ax_total) = plt.subplots(2, 1, sharex=True, figsize=(11, 7), layout="constrained",
                                            gridspec_kw={"height_ratios": [3, 1.3]})
    x_edges, y_edges = _edges(steps), np.arange(len(layers) + 1) - 0.5
    finite = grid[np.isfinite(grid)]
    if finite.size:
        vmin, vmax = float(finite.min()), float(finite.max())
        mesh = ax_heat.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(grid), cmap="viridis", shading="flat",
                                  norm=LogNorm(vmin=vmin, vmax=vmax if vmax > vmin else vmin * 10))
        fig.colorbar(mesh, ax=ax_heat, label="layer gradient L2 norm (log)")
    if np.isfinite(bad).any():
        ax_heat.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(bad), cmap=ListedColormap(["red"]), shading="flat")
        ax_heat.legend(handles=[Patch(color="red", label="non-finite norm")], loc="upper left", fontsize="small")
    ax_heat.set_yticks(range(len(layers)))
    ax_heat.set_yticklabels(layers, fontsize="small" if len(layers) < 40 else "xx-small")
    ax_heat.set_ylabel("layer")
    fig.suptitle(f"gradient norms, {report.directory}")
    _plot_totals(ax_total, by_step, steps)
    for rec in report.incidents:
        step = rec.get("step")
        if not isinstance(step, (int, float)) or not math.isfinite(step):
            continue
        color = SEVERITY_COLORS.get(str(rec.get("severity")), "gray")
        for ax in (ax_heat, ax_total):
            ax.axvline(step, color=color, linestyle="--", linewidth=1, alpha=0.8)
        ax_heat.annotate(str(rec.get("kind", "?")), (step, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(2, 2), textcoords="offset points", color=color, fontsize="small", rotation=90,
                         va="bottom")
    try:
        fig.savefig(out_path, dpi=120)
    except (OSError, ValueError) as exc:  # ValueError: an extension matplotlib cannot write
        raise UserError(f"cannot write plot to {out_path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        plt.close(fig)
