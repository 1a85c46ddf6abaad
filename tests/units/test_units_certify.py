"""One certification for every rollback target (issue 60 item 3, megatron_patches.certify): the
in-memory snapshots, the harness's checkpoints and Megatron-LM's checkpoint marks all count their
clean checks through one Certifier, so the three agree on the same verdicts."""

import pytest

from megatron_patches.certify import Certifier
from megatron_patches.snapshots import SnapshotStore

pytestmark = pytest.mark.one_line  # no megatron-core: the same on every line


def test_a_target_is_certified_by_its_nth_clean_check_and_a_flag_drops_those_still_waiting():
    certifier = Certifier(certify_steps=2)
    certifier.add(2, "two")
    certifier.add(4, "four")
    assert certifier.note_check(3, flagged=False) == ([], [])  # one clean check for 2; 4 is not judged by 3
    assert certifier.note_check(4, flagged=False) == (["two"], [])  # 2's second; 4 not judged by its own step
    assert certifier.waiting() == ["four"]
    assert certifier.note_check(5, flagged=True) == ([], ["four"])
    assert certifier.waiting() == []


def test_a_discarded_target_is_judged_no_more():
    certifier = Certifier(certify_steps=1)
    target = object()
    certifier.add(2, target)
    certifier.discard(target)
    assert certifier.note_check(3, flagged=False) == ([], [])


def test_the_snapshots_and_the_harness_checkpoints_certify_alike(tmp_path):
    """The same sequence of checks through a snapshot store and the harness's checkpoint
    certification leaves the same steps as targets."""
    from megatron_patches.checkpoint import Certification, checkpoint_dir, newest_healthy, write_marker

    import torch

    store, certification, live = SnapshotStore(interval=1, kept=8, certify_steps=2), Certification(2, rank=0), [
        torch.zeros(1)]
    for step in (2, 4, 6):
        store.take(step, live, {})
        path = checkpoint_dir(str(tmp_path), step)
        (tmp_path / path).mkdir()
        write_marker(path, step, True, certified_at=None)
        certification.awaiting(step, path)
    for step, flagged in ((3, False), (5, False), (6, False), (7, True)):
        store.note_check(step, flagged)
        certification.after_check(step, flagged)
    # 2: clean 3 and 5 -> certified at 5; 4: clean 5 and 6 -> certified at 6; 6: flagged at 7 -> dropped
    assert store.certified() == [2, 4] and [s.certified_at for s in store.snapshots] == [5, 6]
    assert newest_healthy(str(tmp_path))[0] == 4
