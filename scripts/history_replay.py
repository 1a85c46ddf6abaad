"""Replay the history detector offline over recorded log-norms, to choose its thresholds.

Record the input with any run of the harness (thresholds out of reach, so that nothing is
skipped and every step is recorded):

    MEGATRON_PATCHES_HISTORY_TRACE=trace.jsonl python -m megatron_patches.tiny_gpt ... \
        --config guard.yaml    # detectors.history: {zscore: 1.0e9, drift_steps: 1000000}

then judge one or more settings against one or more traces:

    python scripts/history_replay.py trace*.jsonl --zscore 6 8 --min-ratio 4 10 --total-min-ratio 8 16

Each setting is replayed the way the detector runs: a flagged step is not committed to the
statistics (the guard skips it), every other step is. Prints, per setting, the flagged steps
of each trace (level, step, tensor or layer) and the largest z-score and ratio seen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace

import numpy as np

from megatron_patches.config import HistoryConfig
from megatron_patches.detectors.history import _Stats, is_vocabulary, judged_slots, shares


def load(path: str) -> tuple[list[str], list[dict]]:
    names: list[str] = []
    lines = []
    with open(path, encoding="utf-8") as handle:
        for text in handle:
            line = json.loads(text)
            names = line.get("names", names)
            lines.append(line)
    return names, lines


def replay(lines: list[dict], cfg: HistoryConfig, raw: bool = False, names: tuple = ()) -> dict:
    """The flags one setting raises over one trace, and the largest z and ratio per level.
    ``raw``: judge parameters and layers by their norms, as the detector did before it judged
    shares (for comparison)."""
    stats: dict[str, _Stats] = {}
    flags, worst = [], {}
    for line in lines:
        judged = {}
        for level in ("total", "layers", "params"):
            if level not in line:
                continue
            values = np.exp(np.array(line[level], dtype=float))
            values = values if level == "total" or raw else shares(values)
            stats.setdefault(level, _Stats(len(values)))
            floor = cfg.total_min_ratio if level == "total" or raw else cfg.min_ratio
            valid = np.ones(len(values), dtype=bool)
            if not raw and level == "layers":
                valid = judged_slots(len(values))
            elif not raw and level == "params":
                valid = np.array([not is_vocabulary(n) for n in names]) if names else valid
            j = judged[level] = stats[level].judge(values, valid, cfg, drift=level != "params", min_ratio=floor)
            warm = (stats[level].count >= cfg.warmup_steps) & valid
            if warm.any():
                ratio = math.exp(float(np.max(np.where(warm, j.logn - stats[level].mean, -np.inf))))
                z = float(np.max(np.where(warm, j.z, -np.inf)))
                old = worst.get(level, (-math.inf, -math.inf))
                worst[level] = (max(old[0], z), max(old[1], ratio))
        hit = [(level, kind, int(i)) for level, j in judged.items()
               for kind, mask in (("zscore", j.zflag), ("drift", j.dflag)) for i in np.flatnonzero(mask)]
        if hit:
            flags.append((line["step"], hit))
        else:
            for level, j in judged.items():
                stats[level].update(j, cfg)
    return {"flags": flags, "worst": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--zscore", type=float, nargs="+", default=[HistoryConfig.zscore])
    parser.add_argument("--min-ratio", type=float, nargs="+", default=[HistoryConfig.min_ratio])
    parser.add_argument("--drift-steps", type=int, nargs="+", default=[HistoryConfig.drift_steps])
    parser.add_argument("--drift-ratio", type=float, nargs="+", default=[HistoryConfig.drift_ratio])
    parser.add_argument("--warmup-steps", type=int, nargs="+", default=[HistoryConfig.warmup_steps])
    parser.add_argument("--total-min-ratio", type=float, nargs="+", default=[HistoryConfig.total_min_ratio])
    parser.add_argument("--raw", action="store_true",
                        help="judge parameters and layers by their norms, not their shares (the old way)")
    parser.add_argument("--verbose", action="store_true", help="list every flagged step")
    args = parser.parse_args()
    traces = {path: load(path) for path in args.traces}
    for z, ratio, dsteps, dratio, warmup, total_ratio in itertools.product(args.zscore, args.min_ratio, args.drift_steps,
                                                              args.drift_ratio, args.warmup_steps, args.total_min_ratio):
        cfg = replace(HistoryConfig(), zscore=z, min_ratio=ratio, drift_steps=dsteps, drift_ratio=dratio,
                      warmup_steps=warmup, total_min_ratio=total_ratio)
        total = 0
        print(f"zscore {z} min_ratio {ratio} drift {dsteps} x {dratio} warmup {warmup} total_min_ratio {total_ratio}")
        for path, (names, lines) in traces.items():
            result = replay(lines, cfg, args.raw, tuple(names))
            total += len(result["flags"])
            worst = ", ".join(f"{level} z {w[0]:.1f} x{w[1]:.1f}" for level, w in sorted(result["worst"].items()))
            print(f"  {path}: {len(lines)} steps, {len(result['flags'])} flagged; largest {worst}")
            if args.verbose:
                for step, hit in result["flags"]:
                    where = [f"{level}:{kind}:{names[i] if level == 'params' and i < len(names) else i}"
                             for level, kind, i in hit]
                    print(f"    step {step}: {' '.join(where)}")
        print(f"  => {total} flagged steps")


if __name__ == "__main__":
    main()
