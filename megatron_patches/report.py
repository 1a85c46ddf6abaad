"""Read ``incidents.jsonl`` and ``grad_history.jsonl`` back and explain them to a person.

Reading is forgiving: an empty or missing file, a half-written last line (the job died
mid-write), a line that is not JSON or one with another schema each become a *problem*
naming file and line, and every readable record is still used. ``megatron-patches report``
(:mod:`megatron_patches.cli`) is the command-line face of this module; the alert sinks use
:func:`headline` and :func:`diagnosis` for their text.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import UserError
from .incidents import HISTORY_FILE, HISTORY_SCHEMA, INCIDENT_SCHEMA, INCIDENTS_FILE

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
    if with_history:
        report.history = read_jsonl(os.path.join(directory, HISTORY_FILE), HISTORY_SCHEMA, report.problems)
    return report


# --- text -------------------------------------------------------------------------------


def _ranks(param: Optional[dict]) -> dict:
    ranks = (param or {}).get("ranks")
    return ranks if isinstance(ranks, dict) else {}


def _count(value: Any) -> int:
    return len(value) if isinstance(value, (list, dict)) else 0


def _text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def table_rows(incidents: list[dict]) -> list[list[str]]:
    header = ["step", "severity", "kind", "first parameter", "layer", "tp/pp/dp", "rank", "host", "action", "replay"]
    rows = [header]
    for rec in incidents:
        first = rec.get("first") if isinstance(rec.get("first"), dict) else None
        ranks = _ranks(first)
        replay = rec.get("replay") if isinstance(rec.get("replay"), dict) else {}
        rows.append([
            _text(rec.get("step")), _text(rec.get("severity")), _text(rec.get("kind")),
            _text((first or {}).get("name")), _text((first or {}).get("layer")),
            "/".join(_text(ranks.get(k)) for k in ("tp", "pp", "dp")) if ranks else "-",
            _text(ranks.get("global")), _text((first or {}).get("host")),
            _text(rec.get("action")), _text(replay.get("verdict")),
        ])
    return rows


def format_table(incidents: list[dict]) -> str:
    rows = table_rows(incidents)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def headline(rec: dict) -> str:
    """One line: step, severity, kind and the message."""
    kinds = rec.get("kinds") if isinstance(rec.get("kinds"), list) else []
    message = rec.get("message") or ", ".join(map(str, kinds)) or "no message"
    return f"step {_text(rec.get('step'))} {_text(rec.get('severity'))} {_text(rec.get('kind'))}: {message}"


def _where(param: dict) -> str:
    ranks = _ranks(param)
    layer = param.get("layer")
    labels = (("nan", "NaN"), ("inf", "Inf"), ("overflow", "overflowed"))
    counts = ", ".join(f"{param[k]} {label}" for k, label in labels if param.get(k))
    norm = param.get("norm")
    rank = f"global rank {_text(ranks.get('global'))}"
    if ranks:
        rank += " (" + ", ".join(f"{k} {_text(ranks.get(k))}" for k in ("tp", "pp", "dp")) + ")"
    parts = [
        f"{param.get('name', '?')}" + (f" (layer {layer})" if layer is not None else " (not in a layer)"),
        rank,
        f"host {_text(param.get('host'))}" + (f" {param['device']}" if param.get("device") else ""),
    ]
    if counts:
        parts.append(counts)
    elif isinstance(norm, (int, float)):
        parts.append(f"grad norm {norm:.4g}")
    return ", ".join(parts)


def _entry(rec: dict) -> Optional[dict]:
    """Where the fault entered: ``first``, unless the origin rank's own finding from before the
    data-parallel reduction is known and ``first`` is elsewhere (records written before the
    origin led)."""
    first = rec.get("first") if isinstance(rec.get("first"), dict) else None
    origins = rec.get("origin_ranks") if isinstance(rec.get("origin_ranks"), list) else []
    before = [p for p in rec.get("pre_reduction") or [] if isinstance(p, dict)
              and _ranks(p).get("global") in origins] if isinstance(rec.get("pre_reduction"), list) else []
    if before and _ranks(first).get("global") not in origins:
        return max(before, key=lambda p: p.get("order") if isinstance(p.get("order"), int) else -1)
    return first


def diagnosis(rec: dict) -> list[str]:
    """Four lines: what broke, where it entered (the forward pass's first non-finite
    module when a replay found it), how far it spread, what was done."""
    lines = [headline(rec)]
    first = _entry(rec)
    forward = rec.get("forward_origin") if isinstance(rec.get("forward_origin"), dict) else None
    if forward:
        layer = forward.get("layer")
        lines.append(f"  entered at: the forward pass, output of {_text(forward.get('module'))}"
                     + (f" (layer {layer})" if isinstance(layer, int) else "")
                     + f" on rank(s) {forward.get('ranks')}, found by the replay; backward carried it to the "
                     + "gradients" + (f" (first: {_text(first.get('name'))})" if first else ""))
    elif rec.get("all_gradients_nonfinite") is True:
        lines.append("  entered at: the forward pass (every gradient is non-finite, so the loss or an activation "
                     "broke first); without a replay not located further"
                     + (f"; {_text(first.get('name'))}, named first, is not the suspect" if first else ""))
    elif first:
        lines.append(f"  entered at: {_where(first)}")
    else:
        lines.append("  entered at: not localized to a parameter (a model-wide check tripped)")
    world = rec.get("world") if isinstance(rec.get("world"), dict) else {}
    size = world.get("size")
    spread = (f"{_count(rec.get('ranks_affected'))} of {_text(size)} ranks, "
              f"{_count(rec.get('params'))} parameter(s)")
    origins = rec.get("origin_ranks") if isinstance(rec.get("origin_ranks"), list) else []
    if origins:
        replicas = (world["dp"] * world.get("cp", 1) if isinstance(world.get("dp"), int)
                    and isinstance(world.get("cp", 1), int) else None)
        reached = rec.get("replicas_reached")
        reached = reached if isinstance(reached, int) else _text(replicas)  # older records: the reduction reaches all
        spread = (f"from rank(s) {origins} before the data-parallel reduction to {reached} of "
                  f"{_text(replicas)} data-parallel replica(s); found after it on {spread}")
    lines.append(f"  spread: {spread}")
    done = [f"action {_text(rec.get('action'))}"]
    replay = rec.get("replay") if isinstance(rec.get("replay"), dict) else None
    if replay and replay.get("verdict"):
        meaning = {"deterministic": "the same batch reproduced it: suspect data or code",
                   "transient": "the replay was clean: suspect hardware or a race"}.get(str(replay["verdict"]), "")
        done.append(f"replay {replay['verdict']}" + (f" ({meaning})" if meaning else ""))
    if isinstance(rec.get("rolled_back_to"), int):
        done.append(f"rolled back to the healthy checkpoint of step {rec['rolled_back_to']}"
                    + (f", learning rate x{rec['lr_scale']:g}" if isinstance(rec.get("lr_scale"), (int, float)) else ""))
    if isinstance(rec.get("blacklisted"), list) and rec["blacklisted"]:
        done.append(f"{len(rec['blacklisted'])} sample(s) blacklisted")
    if isinstance(rec.get("origin_ranks"), list) and rec["origin_ranks"]:
        done.append(f"entered before the data-parallel reduction on rank(s) {rec['origin_ranks']}")
    if rec.get("reason"):
        done.append(f"graded {_text(rec.get('severity'))}: {rec['reason']}")
    samples = rec["batch"].get("samples") if isinstance(rec.get("batch"), dict) else None
    if isinstance(samples, list) and samples:
        shown = ", ".join(map(str, samples[:4])) + (", ..." if len(samples) > 4 else "")
        done.append(f"batch of {len(samples)} sample(s) [{shown}]")
    if rec.get("scene"):
        done.append(f"scene {rec['scene']}")
    if rec.get("injected"):
        done.append("injected by a drill: " + _drills(rec["injected"]))
    lines.append("  done: " + "; ".join(done))
    return lines


def _drills(injected: Any) -> str:
    """What fired: ``nan:step=3,... -> decoder.layers.1.mlp.linear_fc1.weight on rank 1``."""
    if not isinstance(injected, list):
        return _text(injected)
    said = []
    for entry in injected:
        if isinstance(entry, dict):
            target = (f"sample {entry['sample']}" if "sample" in entry else
                      f"output of {entry['module']}" if "module" in entry else _text(entry.get("param")))
            text = f"{_text(entry.get('drill'))} -> {target} on rank {_text(entry.get('rank'))}"
        else:  # records written before 'injected' said what fired: the spec text
            text = _text(entry)
        if text not in said:
            said.append(text)
    return "; ".join(said)


def format_text(report: Report) -> str:
    if not report.incidents:
        return f"no incidents in {report.directory}"
    blocks = [format_table(report.incidents), ""]
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
        "counts": {
            "total": len(report.incidents),
            "severity": dict(Counter(str(r.get("severity")) for r in report.incidents)),
            "kind": dict(Counter(str(r.get("kind")) for r in report.incidents)),
            "action": dict(Counter(str(r.get("action")) for r in report.incidents)),
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
