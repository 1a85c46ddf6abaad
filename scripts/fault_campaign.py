"""The fault campaign (issue 40): every fault kind x scope x target of the drills' menu, on one
rank, DP2 (bf16, distributed optimizer), TP2 and PP2 through the tiny-GPT harness, and EP2 and CP2
through Megatron-LM's own loop (megatron-core 0.17+, Python 3.12), each with the guard's defaults and
with every detector on (``+full``: the state audit, gradient peaks and activations as well), scored
strictly (scripts/campaign_cells.py says how). Writes OUT/campaign.json (or --json) and OUT/campaign.md.

    .venv/bin/python scripts/fault_campaign.py --out runs/campaign            # the harness layouts
    .venv312/bin/python scripts/fault_campaign.py --layouts ep2 cp2 ep2+full cp2+full --out runs/loop
    .venv/bin/python scripts/fault_campaign.py --quick --out runs/campaign    # one scope per kind
    .venv/bin/python scripts/fault_campaign.py --from-json docs/campaign.json --write-docs

One training carries many cells: a fault every GAP steps after a warm-up, each followed by clean
control steps; where a fault lasts (weights, optimizer state) a checkpoint before every other fault
(the harness) or the loop's in-memory snapshots are the rollback target. A run that stops early is
not retried for the cell it stopped in (scored not recovered); the cells after it go to a fresh
run. A cell after the first whose training shows what its fault should not make is trained again
alone (:func:`alone`). The ranks are forked from this process as
the tests fork them (tests/conftest.py), so a run costs its steps, not a start-up. Progress: one
line per cell.

The guard runs at its defaults except where one fault would change how the next is judged: the
escalation of recurring incidents, the rollback cap and the learning-rate cut are turned off,
and scenes are not written (speed); detection and naming are the shipped ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO)]

import campaign_cells as cc  # noqa: E402

CONFIG = {"response": {"recur_count": 1000, "hardware_repeat": 1000},  # scored per cell, never fenced
          "recovery": {"max_rollbacks": 1000, "lr_factor": 1.0, "blacklist": "deterministic"},
          "scene": {"enabled": False}}
BEGIN, END = "<!-- campaign:begin (scripts/fault_campaign.py --write-docs) -->", "<!-- campaign:end -->"
_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss (\S+)")
_LOOP_STEP = re.compile(r"(?:\] iteration|\[megatron_patches\] redone iteration)\s+(\d+)/\s*\d+ \|.*?lm loss: ([^ |]+)")
_FED = re.compile(r"drill '([^']+)' fired into the token ids .*; (\d+) outside the vocabulary")


def default_runner(out: Path, layout: str, steps: int, config: dict, drills: list, lasting: bool) -> tuple[int, str]:
    """Train ``layout`` for ``steps`` steps under the guard's ``config`` with ``drills`` (``lasting``:
    faults that stay in the weights or the optimizer state until a rollback): the tiny-GPT harness,
    or Megatron-LM's packaged loop for the layouts of :data:`campaign_cells.LOOP`."""
    from conftest import run_packaged_loop, run_tiny

    nproc, flags, _, _ = cc.LAYOUTS[layout]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "guard.yaml"
    if layout not in cc.LOOP:
        # Checkpoints (the rollback targets, one before each fault) only where a fault stays in the
        # weights or the optimizer state; a gradient or output fault is over once its step is skipped.
        # Each is saved two steps before a fault, so the clean check between certifies it.
        saves = cc.SAVE_INTERVAL if lasting else 0
        path.write_text(json.dumps(config))  # JSON is YAML
        args = ["--steps", str(steps), "--save-interval", str(saves), "--save-from", str(cc.WARMUP - 1),
                "--seed", str(cc.SEED), "--config", str(path), *flags, *(a for d in drills for a in ("--inject", d))]
        run = run_tiny(out, *args, nproc=nproc, timeout=900)
        return run.returncode, run.output
    # The loop's rollback is its default one: in process, to the newest in-memory snapshot (every
    # recovery.snapshot_interval iterations) that a clean check after it certified.
    path.write_text(json.dumps({**config, "report_dir": str(out), "inject": drills}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(path),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS

    return run_packaged_loop(env, [*TINY_GPT_ARGS, "--train-iters", str(steps), "--seed", str(cc.SEED),
                                   "--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--save-interval",
                                   "100000", *flags], nproc=nproc, timeout=900)


def losses_of(output: str) -> dict:
    """Step -> the loss its last execution printed (None when not finite): the harness's lines of
    rank 0, or the loop's iteration lines (a redone iteration's line after the first)."""
    found = {}
    for line in output.splitlines():
        match = _STEP.match(line) or _LOOP_STEP.search(line)
        if match:
            text = match.group(2).lower()
            value = float(text) if text not in ("nan", "inf", "-inf", "-") else None
            found[int(match.group(1))] = value
    return found


def outside_of(output: str) -> dict:
    """Input drill spec -> how many ids it left outside the vocabulary, summed over its lines (one per
    micro-batch it fired into, on any rank)."""
    found: dict = {}
    for match in filter(None, map(_FED.search, output.splitlines())):
        found[match.group(1)] = found.get(match.group(1), 0) + int(match.group(2))
    return found


def train(out: Path, layout: str, steps: int, drills: list, lasting: bool, runner) -> tuple:
    """One training of ``layout`` with ``drills``: its exit code, losses by step, ids left outside
    the vocabulary by drill, and incident records. The ranks' output is kept in OUT/output.log."""
    config = {**CONFIG, **({"detectors": cc.FULL_DETECTORS} if cc.full(layout) else {})}
    code, output = runner(out, layout, steps, config, drills, lasting)
    out.mkdir(parents=True, exist_ok=True)
    (out / "output.log").write_text(output)
    incidents = [json.loads(line) for line in (out / "incidents.jsonl").read_text().splitlines()
                 if line.strip()] if (out / "incidents.jsonl").exists() else []
    return code, losses_of(output), outside_of(output), incidents


def alone(cell, step: int, grouped: dict, workdir: Path, runner) -> dict:
    """``cell`` scored again in a training that carries its fault alone, at the same step.

    A training carries many cells, and every fault before this one that the guard did not skip or
    roll back (one argued undetectable, one it missed) is still in the weights: the control steps
    are then not those of a clean run with this one fault. Where the grouped training showed what
    this fault should not make (incidents on its controls, an end inside them, an incident in the
    window of a fault argued undetectable), this run says whether this fault makes it; the row is
    its score, with the grouped one kept under ``grouped``."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", cell.key)
    code, losses, outside, incidents = train(workdir / f"{name}-alone", cell.layout, step + cc.GAP - 1,
                                             [cell.spec(step)], cell.target in cc.LASTING, runner)
    row = cc.score(cell, step, incidents, losses, code == 0, outside.get(cell.spec(step)))
    row["run"] = f"{name}-alone"
    row["grouped"] = {key: grouped[key] for key in ("run", "detected", "localized", "false_positives", "recovered")}
    return row


def run_group(group: list, workdir: Path, runner, progress) -> list[dict]:
    """Run ``group`` (cells of one layout) in as few trainings as it takes; one row per cell."""
    rows, pending, attempt = [], list(group), 0
    while pending:
        attempt += 1
        layout, lasting = pending[0].layout, pending[0].target in cc.LASTING
        steps = cc.fault_step(len(pending) - 1) + cc.GAP - 1
        out = workdir / f"{layout}-{pending[0].target}-{pending[0].scope}-{attempt}"
        drills = [cell.spec(cc.fault_step(index)) for index, cell in enumerate(pending)]
        code, losses, outside, incidents = train(out, layout, steps, drills, lasting, runner)
        reached = max(losses, default=0)
        done = []
        for index, cell in enumerate(pending):
            step = cc.fault_step(index)
            if step > reached and code != 0:
                break  # never reached: a fresh run carries it
            row = cc.score(cell, step, incidents, losses, code == 0 or step + cc.GAP - 1 <= reached,
                           outside.get(cell.spec(step)))
            row["run"] = out.name
            if index and (row["false_positives"] or not row["recovered"] or row["reason"] and row["detected"]):
                row = alone(cell, step, row, workdir, runner)
            done.append(row)
            progress(row)
            if code != 0 and step + cc.GAP - 1 > reached:
                break  # the run stopped inside this cell's window
        if not done:
            raise RuntimeError(f"run {out} made no progress (exit {code}): {(out / 'output.log').read_text()[-2000:]}")
        rows += done
        pending = pending[len(done):]
    return rows


def campaign(cells: list, workdir: Path, per_run: int, runner=default_runner, quiet: bool = False) -> list[dict]:
    def progress(row: dict) -> None:
        if not quiet:
            mark = "L" if row["localized"] else "d" if row["detected"] else "-" if row["reason"] else "MISS"
            print(f"[campaign] {row['key']:<45} {mark:<4} step {row['step']:>3} "
                  f"ttd {row['steps_to_detect']} fp {row['false_positives']} "
                  f"recovered {row['recovered']} reported {row.get('reported_ranks')} {row.get('reported')}",
                  flush=True)

    rows = []
    groups: dict = {}
    for cell in cells:  # one layout, and lasting targets or not, per training
        groups.setdefault((cell.layout, cell.target in cc.LASTING), []).append(cell)
    for group in groups.values():
        for start in range(0, len(group), per_run):
            rows += run_group(group[start:start + per_run], workdir, runner, progress)
    order = {cell.key: index for index, cell in enumerate(cells)}
    return sorted(rows, key=lambda row: order[row["key"]])


def mark(row: dict) -> str:
    """A table cell: L (localized strictly) / d (detected, not strictly localized) / MISS (detectable,
    not detected) / - (undetectable by design, not detected), then the steps to detect, +N false
    positives, ! when the run did not train on."""
    text = "L" if row["localized"] else "d" if row["detected"] else "-" if row["reason"] else "**MISS**"
    if row["detected"]:
        text += str(row["steps_to_detect"])
    if row["false_positives"]:
        text += f" +{row['false_positives']}fp"
    if not row["recovered"]:
        text += " !"
    return text


def markdown(result: dict) -> str:
    rows, lines = result["rows"], []
    meta = result["meta"]
    lines += [f"Generated by `scripts/fault_campaign.py{' --quick' if meta['quick'] else ''}` "
              f"(seed {meta['seed']}, megatron-core {meta['megatron_core']}, {meta['seconds']:.0f} s on "
              f"{meta['cpus']} CPU cores{'; ' + meta['runs'] if meta.get('runs') else ''}); the JSON is "
              f"`{meta['json']}`. Target parameter `{cc.PARAM}`, "
              f"module `{cc.MODULE}`; DP2 binds local and forward faults to rank 1, gradient, weight and "
              f"state faults to rank {cc.SHARD_HOLDER} (its shard holds the parameter); TP2 and PP2 bind "
              "every fault to rank 1 (TP: its half of the parameter; PP: the stage that holds it), except the "
              f"input faults (the token ids fed to `{cc.EMBEDDING}`, integers: their own menu of kinds), which "
              "PP2 binds to rank 0, the stage that holds the embedding. EP2 and CP2 train through Megatron-LM's own "
              "loop (`megatron.training`, mock data; its rollback is the default one, in process to an in-memory "
              "snapshot): EP2 (4 experts, top-2) binds every fault to rank 1, its gradient, weight and state faults "
              f"to `{cc.EXPERT_PARAM}` (expert 2, held by rank 1 alone); CP2 binds local, forward and input faults to "
              "rank 1 and the others to rank 0, whose optimizer shard holds the parameter.", "",
              "| layout | cells | detected | strictly localized | false positives on controls | recovered | "
              "detectable: detected / localized | undetectable by design |", "|---|---|---|---|---|---|---|---|"]
    for layout, t in result["totals"].items():
        lines.append(f"| {layout} | {t['cells']} | {t['detected']} | {t['localized']} | {t['false_positives']} | "
                     f"{t['recovered']} | {t['detectable_detected']} / {t['detectable_localized']} of "
                     f"{t['detectable']} | {t['by_design']} |")
    lines += ["", "Cells: `L` localized strictly, `d` detected but not strictly localized, `**MISS**` detectable "
              "and not detected, `-` undetectable by design (reason below) and not detected; the digit is the steps "
              "to detect; `+Nfp` incidents on the control steps; `!` the run did not train on.", ""]
    scopes = [s for s in cc.SCOPES if any(r["scope"] == s for r in rows)]
    for layout in dict.fromkeys(r["layout"] for r in rows):
        lines += [f"**{layout}**", "", "| target | kind | " + " | ".join(scopes) + " |",
                  "|---|---|" + "---|" * len(scopes)]
        for target in cc.TARGETS:
            for kind in cc.kinds_of(target):
                mine = {r["scope"]: r for r in rows if (r["layout"], r["target"], r["kind"]) == (layout, target, kind)}
                if mine:
                    lines.append(f"| {target} | {kind} | " + " | ".join(mark(mine[s]) if s in mine else ""
                                                                     for s in scopes) + " |")
        lines.append("")
    lines += ["Undetectable by design (kind, target: scopes covered, why):", ""]
    for (kind, target), (covered, why) in cc.REASONS.items():
        if any(r["kind"] == kind and r["target"] == target for r in rows):
            lines.append(f"- {kind}, {target} ({', '.join(covered)}): {why.rstrip('.')}.")
    valid = [r for r in rows if r["target"] == "input" and r["reason"] == cc.VALID_IDS]
    if valid:
        lines.append(f"- input, where the fault left every id valid ({len(valid)} cells: "
                     f"{', '.join(sorted({r['kind'] for r in valid}))}): {cc.VALID_IDS}.")
    return "\n".join(lines) + "\n"


def write_docs(result: dict, doc: Path) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section to regenerate")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{BEGIN}\n{markdown(result)}{END}{tail}")


def runnable(layout: str) -> bool:
    """Whether this Python can train ``layout``: the loop's layouts need ``megatron.training``."""
    if layout not in cc.LOOP:
        return True
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one scope per kind (the CI test's cells)")
    p.add_argument("--layouts", nargs="+", choices=list(cc.LAYOUTS),
                   help=f"default: all ({', '.join(cc.LAYOUTS)}); --quick: {', '.join(cc.QUICK_LAYOUTS)}")
    p.add_argument("--targets", nargs="+", choices=list(cc.TARGETS), help="default: all")
    p.add_argument("--out", default="runs/campaign", help="where the runs go (default runs/campaign)")
    p.add_argument("--json", help="write the result here (default: OUT/campaign.json)")
    p.add_argument("--per-run", type=int, default=60, help="cells carried by one training (default 60)")
    p.add_argument("--from-json", help="do not run: read this result (for --write-docs)")
    p.add_argument("--write-docs", action="store_true", help="regenerate the section of docs/reliability.md")
    args = p.parse_args(argv)
    if args.from_json:  # the reasons may have been written since: the rows and totals take the current ones
        result = json.loads(Path(args.from_json).read_text())
        by_key = {c.key: c for c in cc.cells(result["meta"]["quick"])}
        for row in result["rows"]:
            row["reason"] = cc.reason_of(by_key[row["key"]], row.get("outside"))
        result["totals"] = cc.totals(result["rows"])
        Path(args.from_json).write_text(json.dumps(result, indent=1) + "\n")
    else:
        from importlib.metadata import version

        layouts = args.layouts or [layout for layout in (cc.QUICK_LAYOUTS if args.quick else cc.LAYOUTS)
                                    if runnable(layout)]
        missing = [layout for layout in layouts if not runnable(layout)]
        if missing:
            p.error(f"{', '.join(missing)} train(s) through Megatron-LM's own loop, which this megatron-core does not "
                    "ship (0.17+ does, on Python 3.12): run this script with .venv312/bin/python")
        if not args.layouts and len(layouts) < len(cc.LAYOUTS) and not args.quick:
            print(f"[campaign] {', '.join(cc.LOOP)} left out: Megatron-LM's loop is not importable here", flush=True)
        os.makedirs(args.out, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="campaign.", dir=args.out))
        started = time.time()
        rows = campaign(cc.cells(args.quick, tuple(layouts), tuple(args.targets or ())), workdir, args.per_run)
        target = Path(args.json or Path(args.out) / "campaign.json")
        result = {"meta": {"quick": args.quick, "seed": cc.SEED, "megatron_core": version("megatron-core"),
                           "seconds": time.time() - started, "cpus": os.cpu_count(), "json": str(target)},
                  "totals": cc.totals(rows), "rows": rows}
        target.write_text(json.dumps(result, indent=1) + "\n")
        (Path(args.out) / "campaign.md").write_text(markdown(result))
        print(json.dumps(result["totals"], indent=1))
        print(f"[campaign] {target}, {Path(args.out) / 'campaign.md'}")
    if args.write_docs:
        write_docs(result, REPO / "docs" / "reliability.md")
    elif args.from_json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
