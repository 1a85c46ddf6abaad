"""The campaign's branch server (megatron_patches/testing/branch_server.py: a layout's trainings
one after the other in one process group) measures what a process per training measures: the
same cells run both ways, on one rank and on DP2, give bit-equal end states, the same losses,
non-finite counts, skipped steps, left-out samples and incidents, and the same scored rows; the
warm-ups, the band and the fault-free controls too."""

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import campaign_cells as cc  # noqa: E402
import fault_campaign as fc  # noqa: E402

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

CELLS = {  # per layout: a skipped step, a rollback, a lasting state fault the defaults miss, a harmless one
    "1rank": [cc.Cell("nan", "element", "grad", "1rank"), cc.Cell("nan", "element", "param", "1rank"),
              cc.Cell("scale:x1000", "all", "exp_avg", "1rank"),
              cc.Cell("bitflip:mantissa_low", "all", "param", "1rank")],
    "dp2": [cc.Cell("inf", "all", "exp_avg_sq", "dp2"), cc.Cell("scale:x1000", "all", "exp_avg", "dp2"),
            cc.Cell("nan", "element", "forward", "dp2")],
}


def _incidents(m: dict, out: Path) -> list:
    """The incident records with what names the run rather than the training left out: the
    time, and the branch's own directory (in the rollback target's path)."""
    text = json.dumps(m["incidents"]).replace(str(out), "<out>")
    return [{k: v for k, v in record.items() if k != "time"} for record in json.loads(text)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN included (the dumps are float32; ``torch.equal`` holds a NaN unequal to itself)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _differences(a: dict, b: dict, out_a: Path, out_b: Path) -> list:
    """What differs between two measurements of one branch (empty: the same, dumps bit for bit)."""
    found = [key for key in ("finished", "stopped", "loss", "nonfinite_max", "nonfinite_end", "skipped", "left_out")
             if a[key] != b[key]]
    if _incidents(a, out_a) != _incidents(b, out_b):
        found.append("incidents")
    if (a["dumps"] is None) != (b["dumps"] is None):
        found.append("dumps")
    for rank, (x, y) in enumerate(zip(a["dumps"] or [], b["dumps"] or [])):
        found += [f"rank {rank} {key}" for key in ("weights", "main", "exp_avg", "exp_avg_sq")
                  if not _bits_equal(x[key], y[key])]
        found += [f"rank {rank} {key}" for key in ("skipped", "nonfinite") if x[key] != y[key]]
    return found


def _recording(layout: fc.Layout) -> dict:
    """Every measurement ``layout`` makes from now on, by branch name."""
    recorded, branch = {}, layout.branch

    def record(name, config, *args):
        recorded[name] = branch(name, config, *args)
        return recorded[name]

    layout.branch = record
    return recorded


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(CELLS))
def test_the_branch_server_measures_what_a_process_per_branch_measures(tmp_path, name):
    layouts = {engine: fc.Layout(name, tmp_path / engine, 300, fc.QUICK_NUDGES, engine) for engine in fc.ENGINES}
    recorded = {engine: _recording(layout) for engine, layout in layouts.items()}
    rows, controls = {}, {}
    try:
        for engine, layout in layouts.items():
            layout.prepare()
            rows[engine] = [layout.cell(cell) for cell in CELLS[name]]
            # A stop: the guard ends the run (exit and restart instead of its in-process rollback);
            # the server answers its code and ends, and the controls after it run in a new one.
            layout.branch("stopped", "defaults", "--recovery", "exit", "--inject", cc.Cell("nan", "element", "param", name).spec())
            controls[engine] = layout.controls(1)
        assert layouts["server"].worker.starts == 2  # the stop ended the first server, nothing else did
        assert recorded["server"]["stopped"]["stopped"] is not None
    finally:
        for layout in layouts.values():
            layout.close()
    server, process = layouts["server"], layouts["process"]
    for config in server.snapshots:  # the warm-ups: the same state saved, bit for bit
        for rank in range(server.nproc):
            a, b = (torch.load(layout.snapshots[config] / f"branch_rank{rank}.pt", weights_only=False)
                    for layout in (server, process))
            assert all(torch.equal(x, y) for key in ("weights", "main") for x, y in zip(a[key], b[key])), config
            assert a["sampler"] == b["sampler"] and a["step"] == b["step"] == cc.WARMUP
    assert server.band == process.band and server.guard_equal == process.guard_equal
    assert sorted(recorded["server"]) == sorted(recorded["process"])
    differ = {branch: _differences(recorded["server"][branch], recorded["process"][branch],
                                   server.workdir / branch, process.workdir / branch) for branch in recorded["server"]}
    assert {k: v for k, v in differ.items() if v} == {}, "branches measuring differently in the server"
    assert rows["server"] == rows["process"]
    assert controls["server"] == controls["process"]
    # The comparison sees one ulp: the nudged clean twin differs from the clean twin in both engines.
    assert _differences(recorded["server"]["nudge-up"], recorded["server"]["twin-observer-0"],
                        server.workdir, server.workdir)
    # The configurations are switched between trainings, not inherited: this menu has rows where
    # the defaults and every detector on answer differently.
    assert any(row["defaults"] != row["full"] for row in rows["server"])
