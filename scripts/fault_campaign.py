"""The fault campaign scored by what a fault does to training (issue 55).

    .venv/bin/python scripts/fault_campaign.py --layouts 1rank dp2      # docs/campaign.jsonl
    .venv/bin/python scripts/fault_campaign.py --quick --out runs/q     # the CI test's cells
    .venv/bin/python scripts/fault_campaign.py --write-docs             # the table from the file

Per layout: one clean warm-up per configuration (the guard observing nothing, its defaults, every
detector on), each saved as a snapshot after ``cc.WARMUP`` steps (megatron_patches/testing/branch.py).
Every branch starts from such a snapshot, so no cell inherits another's fault: the clean twin,
the band (the clean twin with every weight moved by one ulp), and per cell and seed one unguarded
twin (drill fired, nothing observed) that measures the harm and serves both configurations, then
one guarded branch per configuration. A guarded branch is compared with the clean twin that skipped
the iterations its guard skipped (made once per set of skipped steps). Fault-free control runs
(mock and real text, ``--controls`` seeds each) count false positives. scripts/campaign_score.py
scores. A layout's trainings run one after the other in one process group of its ranks
(megatron_patches/testing/branch_server.py: the guard and the model made anew for each, the
snapshot restored); ``--engine process`` forks this process per training instead (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO)]

import campaign_cells as cc  # noqa: E402
import campaign_score as score  # noqa: E402

BEGIN, END = "<!-- campaign:begin (scripts/fault_campaign.py --write-docs) -->", "<!-- campaign:end -->"
JSONL = REPO / "docs" / "campaign.jsonl"
GUARD = {"recovery": {"lr_factor": 1.0, "blacklist": "deterministic"}, "scene": {"enabled": False}}
"""The guard's defaults, but for a rollback's learning rate (kept, so a recovered run can be
bit-equal to its clean twin), a blacklist only of samples a replay reproduced the fault with, and
no fault scenes (speed)."""
NUDGES = ("up", "down", "seed:1", "seed:2", "seed:3")
QUICK_NUDGES = ("up", "seed:1")
LOSS_STEPS = 5
"""The loss compared with the clean twin's: the mean over the last LOSS_STEPS steps (same batches)."""
TEXT = ["--data", f"text:{Path(json.__file__).parent}", "--data-max-mib", "1", "--vocab", "320"]
"""Real text for the controls: the byte tokens of Python's json package sources."""
_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss (\S+)")
_STATE = ("weights", "main", "exp_avg", "exp_avg_sq")
ENGINES = ("server", "process")
"""How a layout's trainings run: ``server``, one after the other in one process group
(megatron_patches/testing/branch_server.py); ``process``, a fork of this process per training
(tests/conftest.py's run_tiny: the engine the server is checked against)."""


def configs() -> dict:
    """The guard's config per name: ``observer`` (every detector off, no replay: the unguarded twin
    that still fires drills), ``defaults`` and ``full``."""
    from megatron_patches.config_detectors import DetectorsConfig

    off = {f.name: {"enabled": False} for f in dataclasses.fields(DetectorsConfig)}
    return {"observer": {"detectors": off, "response": {"origin_check": False, "replay": False},
                         "grad_history": False, "scene": {"enabled": False}},
            "defaults": GUARD, "full": {**GUARD, "detectors": cc.FULL_DETECTORS}}


def losses_of(output: str) -> dict:
    """Step -> the loss its last execution printed (None when not finite), rank 0's lines."""
    found = {}
    for line in output.splitlines():
        match = _STEP.match(line)
        if match:
            value = float(match.group(2)) if match.group(2).lower() not in ("nan", "inf", "-inf") else None
            found[int(match.group(1))] = value if value is None or math.isfinite(value) else None
    return found


def _relative(got: list, clean: list, key: str):
    import torch

    diff = sum(float((a[key] - b[key]).double().square().sum()) for a, b in zip(got, clean))
    base = sum(float(b[key].double().square().sum()) for b in clean)
    value = math.sqrt(diff / base) if base else 0.0
    return value if math.isfinite(value) and all(bool(torch.isfinite(a[key]).all()) for a in got) else None


def distance(got: list, clean: list):
    """The weights' relative L2 distance (model weights and main weights, the larger), or None
    where a value is not finite."""
    values = [_relative(got, clean, key) for key in ("weights", "main")]
    return None if None in values else max(values)


def end_loss(losses: dict):
    values = [losses.get(s) for s in range(cc.END - LOSS_STEPS + 1, cc.END + 1)]
    return None if None in values else sum(values) / len(values)


def loss_delta(loss, clean):
    return None if loss is None or clean is None else abs(loss - clean) / clean


class Layout:
    """One layout's branches: warm-up snapshots, clean twins, the band, cells and controls."""

    def __init__(self, layout: str, workdir: Path, timeout: int, nudges: tuple = NUDGES, engine: str = "server"):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.layout, self.timeout, self.nudges = layout, timeout, nudges
        self.nproc, self.flags = cc.LAYOUTS[layout][:2]
        self.workdir = workdir / layout
        self.worker = None
        if engine == "server":  # every training of the layout in one process group (testing/branch_server.py)
            from megatron_patches.testing.branch_server import BranchWorker

            self.worker = BranchWorker(self.nproc, self.flags, self.workdir / "server")
        self.configs = configs()
        self.snapshots: dict = {}
        self.twins: dict = {}  # (config, skipped steps, samples left out) -> (dumps, end loss)
        self.count = 0

    def _run(self, out: Path, config: str, *args: str) -> tuple[int, str]:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "guard.json"
        path.write_text(json.dumps(self.configs[config]))  # JSON is YAML
        argv = ["--config", str(path), *self.flags, *args]
        if self.worker is not None:
            code, output = self.worker.run(["--out", str(out), *argv], self.timeout)
        else:
            from conftest import run_tiny

            run = run_tiny(out, *argv, nproc=self.nproc, timeout=self.timeout)
            code, output = run.returncode, run.output
        (out / "output.log").write_text(output)
        return code, output

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def warm_up(self) -> None:
        import torch

        weights = {}
        for config in self.configs:
            out = self.workdir / f"warmup-{config}"
            code, output = self._run(out, config, "--steps", str(cc.WARMUP), "--branch-snapshot-at", str(cc.WARMUP))
            if code != 0 or (out / "incidents.jsonl").exists() and (out / "incidents.jsonl").read_text().strip():
                raise RuntimeError(f"the {config} warm-up of {self.layout} was not clean (exit {code}): {output[-3000:]}")
            self.snapshots[config] = out / "checkpoints" / f"iter_{cc.WARMUP:07d}"
            weights[config] = [torch.load(self.snapshots[config] / f"branch_rank{r}.pt", weights_only=False)["weights"]
                               for r in range(self.nproc)]
        self.warmups_equal = all(torch.equal(a, b) for config in weights for ra, rb in
                                 zip(weights[config], weights["observer"]) for a, b in zip(ra, rb))

    def branch(self, name: str, config: str, *args: str) -> dict:
        """Run one branch from ``config``'s snapshot to ``cc.END``; what it measured."""
        import torch

        self.count += 1
        out = self.workdir / name
        shutil.rmtree(out, ignore_errors=True)
        (out / "checkpoints").mkdir(parents=True)
        snapshot = self.snapshots[config]
        os.symlink(snapshot, out / "checkpoints" / snapshot.name)  # the branch's rollback target
        code, output = self._run(out, config, "--steps", str(cc.END), "--branch-from", str(snapshot),
                                 "--branch-dump", *args)
        losses = losses_of(output)
        finished = code in (0, 1) and max(losses, default=0) == cc.END  # 1: the weights ended non-finite
        dumps = [out / cc_dump(r) for r in range(self.nproc)]
        dumps = [torch.load(p, weights_only=False) for p in dumps] if all(p.exists() for p in dumps) else None
        incidents = [json.loads(line) for line in (out / "incidents.jsonl").read_text().splitlines()
                     if line.strip()] if (out / "incidents.jsonl").exists() else []
        nonfinite = {}
        for dump in dumps or []:
            for step, n in dump["nonfinite"].items():
                nonfinite[step] = nonfinite.get(step, 0) + n
        if not finished:
            reached = max(losses, default=cc.WARMUP)
            stopped = f"exit {code} at step {reached}" if code != -9 else f"killed after {self.timeout} s (step {reached})"
        else:
            stopped = None
        return {"finished": finished, "stopped": stopped, "dumps": dumps, "loss": end_loss(losses),
                "nonfinite_max": max(nonfinite.values(), default=0), "nonfinite_end": nonfinite.get(cc.END, 0),
                "skipped": sorted(s for s, v in (dumps[0]["skipped"] if dumps else {}).items() if v),
                "incidents": incidents, "lr_factor_one": True,
                # A rollback goes to the snapshot, so the redo left the blacklisted samples out from its start.
                "left_out": sorted({i for r in incidents for i in r.get("blacklisted") or ()})
                if any(r.get("rolled_back_to") is not None for r in incidents) else []}

    def twin(self, config: str, skipped: tuple, left_out: tuple = ()) -> tuple:
        """The clean twin of ``config`` that skipped the iterations ``skipped`` and was never fed the
        samples ``left_out`` (made once)."""
        key = (config, tuple(skipped), tuple(left_out))
        if key not in self.twins:
            name = f"twin-{config}-{len(self.twins)}"
            args = [*(("--branch-skip", ",".join(map(str, skipped))) if skipped else ()),
                    *(("--branch-blacklist", ",".join(map(str, left_out))) if left_out else ())]
            m = self.branch(name, config, *args)
            if not m["finished"] or m["dumps"] is None or m["nonfinite_max"]:
                raise RuntimeError(f"the clean twin {name} of {self.layout} did not end whole: {m['stopped']}")
            self.twins[key] = (m["dumps"], m["loss"])
            shutil.rmtree(self.workdir / name, ignore_errors=True)
        return self.twins[key]

    def against(self, m: dict, dumps: list, loss) -> dict:
        """``m`` with its distance and loss change from a twin."""
        got = m["dumps"]
        return {"distance": distance(got, dumps) if got else None, "loss_delta": loss_delta(m["loss"], loss),
                "equal": bool(got) and all(__import__("torch").equal(a[k], b[k]) for a, b in zip(got, dumps)
                                           for k in _STATE)}

    def prepare(self) -> None:
        self.warm_up()
        clean, clean_loss = self.twin("observer", ())
        nudged = []
        for mode in self.nudges:
            m = self.branch(f"nudge-{mode.replace(':', '')}", "observer", "--branch-nudge", mode)
            nudged.append({**m, **self.against(m, clean, clean_loss)})
        self.band = score.band_of(nudged)
        self.guard_equal = {c: self.against({"dumps": self.twin(c, ())[0], "loss": self.twin(c, ())[1]},
                                            clean, clean_loss)["equal"] for c in cc.CONFIGS}

    def cell(self, cell: cc.Cell) -> dict:
        name = re.sub(r"[^A-Za-z0-9]+", "-", cell.key)
        clean, clean_loss = self.twin("observer", ())
        unguarded = self.branch(f"{name}-observer", "observer", "--inject", cell.spec())
        unguarded.update(self.against(unguarded, clean, clean_loss))
        figures, harmful = score.harm(unguarded, self.band)
        row = {"key": cell.key, **dataclasses.asdict(cell), "rank": cell.rank(), "spec": cell.spec(),
               "harm": figures, "harmful": harmful}
        for config in cc.CONFIGS:
            m = self.branch(f"{name}-{config}", config, "--inject", cell.spec())
            if m["dumps"] is not None:
                twin = self.against(m, *self.twin(config, tuple(m["skipped"]), tuple(m["left_out"])))
                m.update(twin_equal=twin["equal"], twin_distance=twin["distance"], twin_loss_delta=twin["loss_delta"])
            else:
                m.update(twin_equal=False, twin_distance=None, twin_loss_delta=None)
            row[config] = {**score.score(cell, m, self.band), "left_out": m["left_out"]}
            shutil.rmtree(self.workdir / f"{name}-{config}", ignore_errors=True)
        shutil.rmtree(self.workdir / f"{name}-observer", ignore_errors=True)
        return row

    def controls(self, seeds: int) -> list[dict]:
        """Fault-free runs as long as a branch's training (warm-up and after), ``seeds`` seeds of
        mock data and as many of real text, with each configuration."""
        found = []
        for config in cc.CONFIGS:
            for data, extra in (("mock", []), ("text", TEXT)):
                for seed in range(1, seeds + 1):
                    out = self.workdir / f"control-{config}-{data}-{seed}"
                    code, output = self._run(out, config, "--steps", str(cc.END), "--seed", str(seed), *extra)
                    incidents = [line for line in (out / "incidents.jsonl").read_text().splitlines()
                                 if line.strip()] if (out / "incidents.jsonl").exists() else []
                    found.append({"layout": self.layout, "config": config, "data": data, "seed": seed,
                                  "steps": max(losses_of(output), default=0), "exit": code,
                                  "incidents": len(incidents)})
                    shutil.rmtree(out, ignore_errors=True)
        return found


def cc_dump(rank: int) -> str:
    from megatron_patches.testing.branch import DUMP

    return DUMP.format(rank=rank)


def commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def campaign(cells: list, workdir: Path, controls: int, budget: float = math.inf, timeout: int = 300,
             progress=print, nudges: tuple = NUDGES, engine: str = "server") -> tuple[list, dict]:
    """Run ``cells`` (several layouts allowed) and ``controls`` seeds per data kind; rows and the
    meta/totals line. Cells of a layout not begun ``budget`` seconds after it started are left out
    (the meta says how many ran); its controls run all the same."""
    from importlib.metadata import version

    rows, clean, layouts, code = [], [], {}, commit()  # the code that runs, before anything is written
    for name in dict.fromkeys(c.layout for c in cells):
        started = time.time()
        layout = Layout(name, workdir, timeout, nudges, engine)
        try:
            layout.prepare()
            mine = [c for c in cells if c.layout == name]
            done, cells_started = 0, time.time()
            for cell in mine:
                if time.time() > started + budget:
                    break
                row = layout.cell(cell)
                rows.append(row)
                with open(workdir / "rows.partial.jsonl", "a", encoding="utf-8") as partial:  # kept if the run dies
                    partial.write(json.dumps(row) + "\n")
                done += 1
                progress(f"[campaign] {row['key']:<48} harmful {row['harmful']!s:<5} " + " ".join(
                    f"{c}: {'L' if row[c]['localized'] else 'd' if row[c]['detected'] else '-'}"
                    f"{'' if row[c]['recovered'] else '!'}" for c in cc.CONFIGS))
            cells_seconds, per_cell = time.time() - started, (time.time() - cells_started) / max(done, 1)
            clean += layout.controls(controls)
        finally:
            layout.close()
        layouts[name] = {"cells_planned": len(mine), "cells_run": done, "branches": layout.count,
                         "seconds": round(time.time() - started), "seconds_without_controls": round(cells_seconds),
                         "seconds_per_cell": round(per_cell, 2), "engine": engine,
                         "servers_started": layout.worker.starts if layout.worker else None,
                         "band": layout.band, "warmups_bit_equal": layout.warmups_equal,
                         "guarded_clean_twin_bit_equal_to_unguarded": layout.guard_equal}
    meta = {**code, "layouts": layouts, "megatron_core": version("megatron-core"), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "warmup": cc.WARMUP, "fault_step": cc.FAULT_STEP,
            "after": cc.AFTER, "seeds": sorted({c.seed for c in cells}), "nudges": list(nudges),
            "controls_per_data_kind": controls, "loss_steps": LOSS_STEPS, "guard": GUARD}
    return rows, {"meta": meta, "totals": score.totals(rows, clean), "controls": clean}


def write_jsonl(path: Path, rows: list, tail: dict) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + json.dumps(tail) + "\n")


def read_jsonl(path: Path) -> tuple[list, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines[:-1], lines[-1]


def markdown(rows: list, tail: dict) -> str:
    meta, lines = tail["meta"], []
    lines += [f"Generated by `make campaign` from `docs/campaign.jsonl` (commit {meta['commit'][:7]}"
              f"{' with local changes' if meta['dirty'] else ''}, {meta['date']}, megatron-core {meta['megatron_core']}, "
              f"{meta['cpus']} CPU cores, shared). Every cell is one fault (kind x scope x target x seed) injected at "
              f"step {meta['fault_step']} of a branch from one clean warm-up, scored {meta['after']} steps later.", "",
              "| layout | config | cells run / planned | harmful | strictly localized | recovered | alarms on harmless "
              "| false positives per 10,000 clean steps (runs, steps) | after-fault false positives | time |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for key, t in tail["totals"].items():
        layout, config = key.split("/")
        info = meta["layouts"][layout]
        share = f"{t['localized']} ({100 * t['localized'] / t['harmful']:.1f} %)" if t["harmful"] else "0"
        lines.append(f"| {layout} | {config} | {info['cells_run']} / {info['cells_planned']} | {t['harmful']} | {share} | "
                     f"{t['recovered']} | {t['alarms_on_harmless']} | {t['false_positives_per_10k_clean_steps']} "
                     f"({t['clean_runs']}, {t['clean_steps']}) | {t['false_positives_after_fault']} | "
                     f"{info['seconds']} s |")
    lines += ["", "Bands (the most that one ulp of every weight moved the end loss and the weights): " + "; ".join(
        f"{layout} loss {info['band']['loss']:.2e}, weights {info['band']['weight']:.2e}"
        for layout, info in meta["layouts"].items()) + ".", ""]
    for key, t in tail["totals"].items():
        byname = {r["key"]: r for r in rows}
        lines.append(f"Misses of {key} (harmful, not strictly localized; what the first incident named): " + (", ".join(
            f"`{m}` ({byname[m][key.split('/')[1]].get('reported') or 'nothing'})" for m in t["misses"]) or "none") + ".")
        lines.append("")
    return "\n".join(lines)


def write_docs(rows: list, tail: dict, doc: Path) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section to regenerate")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{markdown(rows, tail)}{END}{rest.split(END, 1)[1]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", choices=list(cc.LAYOUTS), default=list(cc.LAYOUTS),
                   help="harness layouts (default: all)")
    p.add_argument("--targets", nargs="+", choices=list(cc.TARGETS), help="default: all")
    p.add_argument("--quick", action="store_true", help="the CI test's cells (campaign_cells.QUICK)")
    p.add_argument("--controls", type=int, default=15, help="fault-free runs per data kind (mock, text) and config")
    p.add_argument("--budget-minutes", type=float, default=math.inf,
                   help="per layout: begin no cell after this many minutes (default: no limit; the file says which ran)")
    p.add_argument("--out", default="runs/campaign", help="where the branches run (default runs/campaign)")
    p.add_argument("--jsonl", default=str(JSONL), help=f"the result (default {JSONL.relative_to(REPO)})")
    p.add_argument("--engine", choices=ENGINES, default="server",
                   help="server (default): a layout's trainings in one process group; process: a fork per training")
    p.add_argument("--write-docs", action="store_true", help="only regenerate docs/reliability.md's table from --jsonl")
    args = p.parse_args(argv)
    if args.controls < 1:
        p.error(f"--controls must be >= 1, got {args.controls}")
    if not args.budget_minutes > 0:
        p.error(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    if not args.write_docs:
        os.makedirs(args.out, exist_ok=True)
        # Absolute: a branch's rollback target is a symbolic link to its snapshot.
        workdir = Path(tempfile.mkdtemp(prefix="campaign.", dir=args.out)).resolve()
        # Seed by seed, and within a seed scope by scope over every kind and target: a layout cut by
        # --budget-minutes has run whole scopes of its first seeds.
        order = {name: i for i, name in enumerate((*cc.SCOPES, *cc.KINDS, *cc.INPUT_KINDS, *cc.TARGETS))}
        cells = cc.cells(quick=True) if args.quick else sorted(
            cc.cells(tuple(args.layouts), tuple(args.targets or ())),
            key=lambda c: (c.layout, c.seed, order[c.scope], order[c.kind], order[c.target]))
        rows, tail = campaign(cells, workdir, args.controls, args.budget_minutes * 60,
                              nudges=QUICK_NUDGES if args.quick else NUDGES, engine=args.engine)
        write_jsonl(Path(args.jsonl), rows, tail)
        print(json.dumps(tail["totals"], indent=1))
    rows, tail = read_jsonl(Path(args.jsonl))
    if args.write_docs or Path(args.jsonl).resolve() == JSONL:
        write_docs(rows, tail, REPO / "docs" / "reliability.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
