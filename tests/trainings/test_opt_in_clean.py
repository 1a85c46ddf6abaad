"""The opt-in detectors that judge against a history of their own (gradient peaks, activations) on
clean trainings: no incident. One training carries both (each reads what it reads, neither changes
the training), so one run answers for two detectors."""

import pytest

from conftest import CLEAN_RUNS, clean_incidents, clean_text_sweep, detectors_config

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)


def _config(where) -> str:
    return detectors_config(where, peak=True, activations=True)


@pytest.mark.parametrize("ranks, flags", CLEAN_RUNS)
def test_clean_training_raises_nothing(tmp_path, ranks, flags):
    """Seed 2 (the thresholds were looked at on seed 1234's trace): 150 steps, 130 of them judged."""
    found = clean_incidents(tmp_path / "out", _config(tmp_path), ranks, flags)
    assert found == [], found


@pytest.mark.slow
@pytest.mark.multiproc
def test_clean_text_sweep_raises_nothing(tmp_path):
    """2,400 clean steps on real text (conftest.clean_text_sweep)."""
    found = clean_text_sweep(tmp_path, _config(tmp_path))
    assert not any(found.values()), found
