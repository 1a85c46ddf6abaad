"""In-memory snapshots without ranks (megatron_patches.snapshots): which become rollback targets,
which a flagged check drops, which one gives way to a new one, and what the ranks agree on; the
size the start line reckons; the harness's checkpoints certified the same way."""

import json

import torch

from megatron_patches.snapshots import SnapshotStore, common_newest, restore


def store_with(steps: list[int], kept: int = 4, certify: int = 1) -> tuple[SnapshotStore, list]:
    store, live = SnapshotStore(interval=2, kept=kept, certify_steps=certify), [torch.zeros(3)]
    for step in steps:
        live[0].fill_(step)
        store.take(step, live, {"step": step})
    return store, live


def test_a_snapshot_becomes_a_target_after_its_clean_checks_and_a_flag_drops_those_waiting():
    store, _ = store_with([2, 4], certify=2)
    store.note_check(3, flagged=False)  # one clean check for 2
    assert store.certified() == []
    store.note_check(4, flagged=False)
    assert store.certified() == [2] and store.get(2).certified_at == 4
    store.note_check(5, flagged=True)  # 4 had one clean check only: dropped; 2 stays a target
    assert [s.step for s in store.snapshots] == [2] and store.certified() == [2]


def test_the_newest_certified_snapshot_is_never_the_one_to_give_way():
    store, live = store_with([2], kept=2)
    store.note_check(3, flagged=False)
    live[0].fill_(4)
    store.take(4, live, {})
    live[0].fill_(6)
    store.take(6, live, {})  # 4 is still waiting: it goes, the only target stays
    assert [s.step for s in store.snapshots] == [2, 6] and store.certified() == [2]


def test_restore_copies_back_in_place_and_refuses_another_layout():
    store, live = store_with([2, 4])
    view = live[0][:2]  # a view of the live tensor (DDP's buffers) sees the restored values
    restore(store.get(2), live)
    assert view.tolist() == [2.0, 2.0] and live[0].tolist() == [2.0, 2.0, 2.0]
    try:
        restore(store.get(2), live + [torch.zeros(1)])
    except RuntimeError as error:
        assert "holds 1 tensors, the run has 2 now" in str(error)
    else:
        raise AssertionError("a snapshot restored into another layout")


def test_the_ranks_agree_on_the_newest_step_all_of_them_hold():
    assert common_newest([[2, 4, 6], [2, 4], [4, 6]]) == 4
    assert common_newest([[2], [4]]) is None and common_newest([]) is None


class _Leaf:
    """What the snapshot code reads of a megatron-core optimizer leaf: the torch optimizer it steps."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_the_snapshot_size_reckoned_before_the_first_step_is_the_size_after_it():
    """The start line's bound comes before any optimizer state exists: torch's Adam (with and
    without amsgrad) and SGD with momentum create exactly the state reckoned for them."""
    from megatron_patches.seams.megatron_lm.state import live_tensors, snapshot_bytes

    for make in (lambda p: torch.optim.Adam(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=0.1, amsgrad=True),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        main = [p.detach().float().clone().requires_grad_() for p in model.parameters()]  # "main weights"
        leaf = _Leaf(make(main))
        reckoned = snapshot_bytes([model], leaf)
        for p in main:
            p.grad = torch.ones_like(p)
        leaf.optimizer.step()
        assert reckoned == sum(t.numel() * t.element_size() for t in live_tensors([model], leaf)), make


def test_a_harness_checkpoint_is_a_target_once_certified_and_a_resumed_job_certifies_the_last_one(tmp_path):
    """megatron_patches.checkpoint.Certification on the markers the tiny-GPT harness writes: a
    healthy save awaits its clean checks, a flagged check first makes it unhealthy, and a job
    that resumes may load the one the last job could not certify (a rollback may not)."""
    from megatron_patches.checkpoint import (Certification, checkpoint_dir, newest_healthy, newest_resumable,
                                             read_marker, write_marker)

    root = str(tmp_path)
    certification = Certification(certify_steps=2, rank=0)
    for step in (2, 4, 6):
        path = checkpoint_dir(root, step)
        (tmp_path / path).mkdir()
        write_marker(path, step, True, certified_at=None)
        certification.awaiting(step, path)
        if step == 2:
            certification.after_check(3, flagged=False)
            certification.after_check(4, flagged=False)  # 2: certified; 4 (saved after) not judged by it
    assert read_marker(checkpoint_dir(root, 2)) == (2, True)
    assert [read_marker(checkpoint_dir(root, s)) for s in (4, 6)] == [(4, False), (6, False)]  # awaiting
    certification.after_check(5, flagged=False)  # 4: one clean check of two
    certification.after_check(7, flagged=True)  # 4 and 6 awaited: neither becomes a target
    assert newest_healthy(root) == (2, checkpoint_dir(root, 2))
    assert "step 7 was flagged" in json.loads(open(f"{checkpoint_dir(root, 6)}/megatron_patches.json").read())[
        "not_certified"]
    write_marker(checkpoint_dir(root, 6), 6, True, certified_at=None)  # a job that ended after saving 6
    assert newest_resumable(root) == (6, checkpoint_dir(root, 6), True) and newest_healthy(root)[0] == 2
