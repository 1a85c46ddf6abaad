"""Megatron-LM's loop helpers that need no checkout and no training: the rollback target among the
checkpoint markers, the learning-rate scale a checkpoint remembers, the iterations to skip, and the
optional training targets skipped where ``megatron.training`` is absent."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_patches import checkpoint
from megatron_patches.ledger import Ledger
from megatron_patches.seams import megatron_lm


# --- helpers that need no checkout (CI) -------------------------------------------------------------


def _iteration_dir(root: Path, iteration: int, healthy: bool | None) -> None:
    directory = Path(checkpoint.checkpoint_dir(str(root), iteration))
    directory.mkdir(parents=True)
    if healthy is not None:
        megatron_lm.write_marker(str(directory), iteration, healthy, incidents=0)


def test_rollback_target_is_the_newest_healthy_complete_checkpoint(tmp_path):
    _iteration_dir(tmp_path, 2, healthy=True)
    _iteration_dir(tmp_path, 4, healthy=True)
    _iteration_dir(tmp_path, 6, healthy=False)   # an incident since the save at 4
    _iteration_dir(tmp_path, 8, healthy=True)    # async save not finished: past the tracker
    _iteration_dir(tmp_path, 10, healthy=None)   # saved without the guard: unknown, never picked
    (tmp_path / megatron_lm.TRACKER_FILE).write_text("6")
    assert megatron_lm.newest_healthy_iteration(str(tmp_path)) == 4
    (tmp_path / megatron_lm.TRACKER_FILE).write_text("release")
    assert megatron_lm.newest_healthy_iteration(str(tmp_path)) == 8


def test_a_checkpoint_remembers_the_lr_scale_it_was_saved_with(tmp_path):
    # From 0.19 on the optimizer finds saved param groups by max_lr: a restart must know it.
    directory = Path(checkpoint.checkpoint_dir(str(tmp_path), 4))
    directory.mkdir(parents=True)
    assert megatron_lm.saved_lr_scale(str(tmp_path), 4) == 1.0  # no marker: saved unscaled
    megatron_lm.write_marker(str(directory), 4, True, incidents=0, lr_scale=0.25)
    assert megatron_lm.saved_lr_scale(str(tmp_path), 4) == 0.25
    (directory / checkpoint.MARKER).write_text('{"step": 4, "healthy": true, "lr_scale": "nan"}')
    assert megatron_lm.saved_lr_scale(str(tmp_path), 4) == 1.0


def test_iterations_to_skip_follow_each_release_numbering():
    # Up to core 0.16 Megatron-LM tests the 0-based index, from 0.17 on the logged number.
    assert megatron_lm.to_iterations_to_skip([3, 4], (0, 16)) == [2, 3]
    assert megatron_lm.to_iterations_to_skip([3, 4], (0, 17)) == [3, 4]


def test_skip_iterations_survive_later_restarts_in_the_ledger(tmp_path):
    ledger = Ledger(events=[{"step": 4, "exit": 84, "skip_iterations": [3, 4]}, {"resumed_from": 2},
                            {"step": 9, "exit": 84, "skip_iterations": [9]}])
    ledger.save(str(tmp_path))
    assert megatron_lm.skip_iterations(Ledger.load(str(tmp_path))) == [3, 4, 9]


def test_training_targets_are_skipped_where_megatron_training_is_absent(clean_patches, caplog):
    pytest.importorskip("megatron.core")
    try:
        import megatron.training  # noqa: F401

        pytest.skip("megatron.training is importable here: the optional targets would be installed")
    except ImportError:
        pass
    from megatron_patches.seams import patching
    from megatron_patches.seams.targets import TRAINING_TARGETS

    logger = logging.getLogger("megatron_patches")  # runtime.install() may have stopped propagation
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="megatron_patches"):
            done = patching.install()
    finally:
        logger.removeHandler(caplog.handler)
    assert done and not any(t.dotted in done for t in TRAINING_TARGETS)
    for target in TRAINING_TARGETS:  # said at debug level; the one info line names the module
        assert any(f"{target.dotted} skipped: {target.module} is not importable" in r.message
                   for r in caplog.records if r.levelno == logging.DEBUG)
    summary = [r.message for r in caplog.records if r.levelno >= logging.INFO]
    assert summary and "megatron.training absent (its targets skipped)" in summary[-1], summary
