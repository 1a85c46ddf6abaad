"""The pure halves of issue 57's poisoned sample in Megatron-LM's loop with Megatron's check on: the
replay verdict made of what every rank saw in Megatron's rerun in place, and the iterations a
restarted job skips for the ledger's blacklisted samples. No training, no process group."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from megatron_patches.cause import Signs, classify
from megatron_patches.seams.megatron_lm.replay import rerun_verdict
from megatron_patches.seams.megatron_lm.rollback import blacklisted_iterations

FED = ([16, 17], [18, 19])
"""Rank 0's and rank 1's positions of one iteration (DP2, micro-batch 2)."""


def test_a_row_non_finite_again_in_megatrons_rerun_is_a_narrowed_deterministic_verdict_and_data():
    verdict = rerun_verdict([([17], FED[0], "reproducible"), ([], FED[1], None)])
    assert verdict == {"verdict": "deterministic", "narrowed": True, "samples": [17]}
    verdict.pop("samples")
    cause = classify(Signs(step=5, origin_ranks=(0,), origin_replicas=1, replicas=2), verdict)
    assert (cause.klass, cause.confidence) == ("data", "high")


def test_a_fault_megatrons_rerun_found_gone_is_transient_and_hardware_with_no_sample():
    verdict = rerun_verdict([([], FED[0], "transient"), ([], FED[1], None)])
    assert verdict == {"verdict": "transient", "narrowed": False, "samples": []}
    verdict.pop("samples")
    assert classify(Signs(step=8, origin_ranks=(0,), origin_replicas=1, replicas=2), verdict).klass == "hardware"


def test_a_rerun_that_reproduced_no_sample_loss_gives_no_verdict():
    # A gradient NaN reproduced (bucket norm) with every loss finite names no sample: no verdict.
    assert rerun_verdict([([], FED[0], "reproducible"), ([], FED[1], None)]) is None
    # One rank found it gone, another reproduced it: not transient.
    assert rerun_verdict([([], FED[0], "transient"), ([], FED[1], "reproducible")]) is None
    assert rerun_verdict([([], FED[0], None), ([], FED[1], None)]) is None


def test_every_row_non_finite_again_is_deterministic_but_not_narrowed():
    assert rerun_verdict([([16, 17], FED[0], "reproducible"), ([18, 19], FED[1], "reproducible")]) == {
        "verdict": "deterministic", "narrowed": False, "samples": [16, 17, 18, 19]}


def _args(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{"dataloader_type": "single", "global_batch_size": 4, "rampup_batch_size": None, **changes})


def test_a_blacklisted_sample_skips_the_iteration_that_reads_it_on_a_restart():
    assert blacklisted_iterations([], _args()) == []
    assert blacklisted_iterations([17], _args()) == [5]  # iteration 5 reads 16..19
    assert blacklisted_iterations([16, 19, 20, 0], _args()) == [1, 5, 6]
    assert blacklisted_iterations([17], _args(global_batch_size=8)) == [3]


def test_where_the_iterations_of_a_sample_are_unknown_nothing_is_skipped_with_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_patches"):
        assert blacklisted_iterations([17], _args(dataloader_type="cyclic")) == []
        assert blacklisted_iterations([17], _args(rampup_batch_size=[2, 2, 100])) == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("known only for --dataloader-type single without --rampup-batch-size" in line
                                   for line in lines), lines
