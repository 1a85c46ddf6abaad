"""``make demo`` as the Makefile runs it (its flags read from the recipe): no checkpoint flag, a NaN
gradient at step 12 skipped, a NaN written into a weight at step 20 rolled back in memory (issue 60's
Done-when), the run the README quotes. Four ranks for 30 steps: make test-all."""

import re
import shlex
from pathlib import Path

import pytest

from conftest import assert_trained, run_tiny

pytestmark = [pytest.mark.one_line, pytest.mark.multiproc, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def demo_flags() -> tuple[int, list[str]]:
    """(--nproc-per-node, the harness's flags) of the Makefile's demo recipe, --out left out."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndemo:"):].split("\n\n", 1)[0]
    command = recipe[recipe.index("-m megatron_patches.tiny_gpt"):].split("\n\t$(VPY)", 1)[0]
    words = shlex.split(command.replace("\\\n", " "))[2:]
    out = words.index("--out")
    return int(re.search(r"NPROC \?= (\d+)", makefile).group(1)), words[:out] + words[out + 2:]


def test_make_demo_skips_a_nan_gradient_and_rolls_a_lasting_fault_back_in_memory_without_a_checkpoint(tmp_path):
    nproc, flags = demo_flags()
    assert nproc == 4 and not any(flag.startswith(("--save", "--resume")) for flag in flags)
    run = run_tiny(tmp_path, *flags, nproc=nproc, timeout=600)
    result = assert_trained(run)
    skip, rollback = run.incidents
    assert (skip["step"], skip["action"], skip["replay"]["verdict"]) == (12, "skip_step", "transient")
    assert (rollback["step"], rollback["action"], rollback["rolled_back_to"], rollback["checkpoint"]) == (
        21, "rollback", 15, "in-memory snapshot")
    assert rollback["first"]["name"] == "decoder.layers.0.mlp.linear_fc2.weight" and rollback["origin_ranks"] == [2]
    assert (result["rollbacks"], result["steps_completed"], result["params_finite"]) == (1, 30, True)
    assert "rolled back from step 21 to in-memory snapshot (step 15); lr scale 0.5" in run.output
    assert not list(tmp_path.glob("**/iter_*"))  # no checkpoint was written
