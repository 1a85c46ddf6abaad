"""The cause of an incident (megatron_patches.cause) and the response that follows it
(megatron_patches.cause_response), from hand-made signs: no process group, no training."""

import os

import pytest

from megatron_patches import checkpoint
from megatron_patches.cause import Cause, Device, Signs, classify, growth_of
from megatron_patches.cause_response import disqualify, fence_decision, healthy_target
from megatron_patches.decisions import Action, Decision, ExitCodesConfig, Severity, exit_code
from megatron_patches.ledger import Ledger

GPU3 = Device(3, "node7", "cuda:3")
DETERMINISTIC = {"verdict": "deterministic", "narrowed": True}
EVERY_MICRO_BATCH = {"verdict": "deterministic", "narrowed": False}
TRANSIENT = {"verdict": "transient"}


def test_a_batch_the_replay_reproduces_on_some_micro_batches_is_data():
    cause = classify(Signs(step=6, origin_ranks=(1,), origin_replicas=1, replicas=2), DETERMINISTIC)
    assert (cause.klass, cause.confidence) == ("data", "high")
    assert "on some of the step's micro-batches only" in cause.evidence
    assert "it entered on one replica (rank(s) 1)" in cause.evidence


def test_a_corrupt_held_state_is_hardware_though_the_replay_reproduces_it():
    # The measured bug: a NaN in rank 0's exp_avg_sq reproduces on replay; the state, not the batch, does that.
    signs = Signs(step=7, held_ranks=(0,), origin_ranks=(0,), origin_replicas=1, replicas=2, suspects=(GPU3,))
    cause = classify(signs, EVERY_MICRO_BATCH)
    assert (cause.klass, cause.confidence, cause.devices) == ("hardware", "high", (GPU3,))
    assert cause.evidence[-1] == "the replay reproduced the fault from that state, so the batch is not its cause"
    # Negative control: the same replay without the held corruption is the data's.
    assert classify(Signs(step=7, origin_ranks=(0,), origin_replicas=1, replicas=2), DETERMINISTIC).klass == "data"


def test_a_held_state_that_unchecked_gradients_fed_is_hardware_with_less_confidence():
    cause = classify(Signs(step=7, held_ranks=(0,), checked_every_step=False))
    assert cause.evidence == ("non-finite values in the weights or optimizer state held on rank(s) 0",)
    assert (cause.klass, cause.confidence) == ("hardware", "medium")


@pytest.mark.parametrize("signs, replay, why", [
    (Signs(step=9, altered_ranks=(2,)), None, "the state of rank(s) 2 changed between two updates"),
    (Signs(step=9, replicas_disagree=True), EVERY_MICRO_BATCH, "replicas that should agree bit for bit differ"),
    (Signs(step=9, origin_ranks=(1,), origin_replicas=1, replicas=2), TRANSIENT,
     "a replay of the step on rank(s) 1 from the same state and batch was clean"),
])
def test_hardware_signs(signs, replay, why):
    cause = classify(signs, replay)
    assert cause.klass == "hardware" and cause.evidence[0].startswith(why)


def test_growth_before_the_fault_is_numerics_and_a_flat_trail_is_not():
    rising = [0.5, 0.8, 1.3, 2.1, 3.5, 6.0]
    growth = growth_of(rising, float("inf"))
    assert growth == ("gradient norm rose 12x over the 6 clean checked steps before",)
    assert growth_of(rising, 9.0)[0].endswith(", to 9 at the fault")
    cause = classify(Signs(step=12, growth=growth), EVERY_MICRO_BATCH)
    assert (cause.klass, cause.confidence) == ("numerics", "high")
    # Negative controls: a flat trail, a single jump, too few steps: no growth, so not numerics.
    assert growth_of([1.0, 1.1, 0.9, 1.0, 1.05, 1.0], float("nan")) == ()
    assert growth_of([1.0, 1.0, 1.0, 1.0, 1.0, 9.0], None) == ()
    assert growth_of([1.0, 5.0, 25.0], None) == ()
    assert classify(Signs(step=12), TRANSIENT).klass == "hardware"


def test_an_adam_moment_beyond_2_100_is_numerics_after_a_growth_and_hardware_without_one():
    grown = classify(Signs(step=30, held_ranks=(1,), held_extreme_only=True, growth=("gradient norm rose 9x",)))
    assert grown.klass == "numerics" and "a held value grew beyond 2^100 and stayed finite" in grown.evidence
    # Negative control: the same value with a flat trail is a flipped top exponent bit.
    flipped = classify(Signs(step=30, held_ranks=(1,), held_extreme_only=True))
    assert flipped.klass == "hardware"
    assert flipped.evidence[0] == "values beyond 2^100 in the weights or optimizer state held on rank(s) 1"


def test_every_replica_from_the_first_check_reproduced_on_every_micro_batch_is_software():
    signs = Signs(step=1, first_checked=True, origin_ranks=(0, 1), origin_replicas=2, replicas=2)
    assert classify(signs, EVERY_MICRO_BATCH).klass == "software"
    # Negative controls: later in the job, on some micro-batches only, on one replica of two.
    later = Signs(step=9, first_checked=False, origin_ranks=(0, 1), origin_replicas=2, replicas=2)
    assert classify(later, EVERY_MICRO_BATCH).klass == "data"
    assert classify(signs, DETERMINISTIC).klass == "data"
    one = Signs(step=1, first_checked=True, origin_ranks=(0,), origin_replicas=1, replicas=2)
    assert classify(one, EVERY_MICRO_BATCH).klass == "data"


def test_without_a_replay_or_a_sign_the_cause_is_unknown():
    cause = classify(Signs(step=5))
    assert (cause.klass, cause.confidence) == ("unknown", "low")
    assert Cause("unknown", (), "low").record() == {"class": "unknown", "evidence": [], "confidence": "low"}
    with pytest.raises(ValueError, match="cause class must be one of"):
        Cause("cosmic", (), "low")


def test_token_ids_outside_the_vocabulary_are_data():
    assert classify(Signs(step=3, fed_ranks=(1,), held_ranks=(1,)), None).klass == "data"


def _hardware(step: int, device: Device = GPU3) -> tuple[Cause, Decision]:
    cause = Cause("hardware", ("held",), "high", (device,))
    return cause, Decision(Severity.ERROR, Action.ROLLBACK, "anomaly", step)


def test_the_second_hardware_incident_on_one_device_fences_it_with_the_fence_code():
    ledger = Ledger()
    cause, decision = _hardware(7)
    assert fence_decision(ledger, cause, decision, repeat=2, code=88, rank=0) is decision
    # The next checked step's incident continues the same fault: not counted again.
    cause, again = _hardware(8)
    assert fence_decision(ledger, cause, again, repeat=2, code=88, rank=0) is again and len(ledger.hardware) == 1
    # Another device's incident does not add to this one's count.
    other, decision = _hardware(9, Device(1, "node7", "cuda:1"))
    assert fence_decision(ledger, other, decision, repeat=2, code=88, rank=0) is decision
    cause, decision = _hardware(15)
    fenced = fence_decision(ledger, cause, decision, repeat=2, code=88, rank=0)
    assert (fenced.severity, fenced.action) == (Severity.CRITICAL, Action.FENCE)
    assert "fence: 2 hardware-class incidents on host node7 device cuda:3 (rank 3) in this job, at steps [7, 15]" \
        in fenced.reason
    assert ledger.fenced == {"host": "node7", "device": "cuda:3", "rank": 3, "step": 15, "incidents": 2}
    assert exit_code(fenced) == 88 and exit_code(fenced, ExitCodesConfig(fence=91)) == 91
    # Negative control: a data-class incident counts nothing.
    before = list(ledger.hardware)
    data = Cause("data", ("replay",), "high")
    assert fence_decision(ledger, data, decision, repeat=2, code=88, rank=0) is decision
    assert ledger.hardware == before


def test_the_fence_count_survives_the_ledger_written_and_read_again(tmp_path):
    ledger = Ledger()
    fence_decision(ledger, *_hardware(7), repeat=2, code=88, rank=0)
    ledger.save(str(tmp_path))
    again = Ledger.load(str(tmp_path))  # the restarted job
    fenced = fence_decision(again, *_hardware(20), repeat=2, code=88, rank=0)
    assert fenced.action == Action.FENCE and Ledger.load(str(tmp_path)).fenced is None
    again.save(str(tmp_path))
    assert Ledger.load(str(tmp_path)).fenced["step"] == 20


def test_a_target_whose_redo_met_the_same_fault_is_disqualified_and_an_older_one_taken(tmp_path):
    root = str(tmp_path)
    for step in (4, 8, 12):
        directory = checkpoint.checkpoint_dir(root, step)
        os.makedirs(directory)
        checkpoint.write_marker(directory, step, healthy=True)
    ledger = Ledger(events=[{"step": 14, "rolled_back_to": 12, "cause": "hardware"}])
    assert healthy_target(root, ledger.disqualified)[0] == 12
    # The redo from 12 met a hardware fault again at step 13, before passing step 14: 12 is out, and 8 taken.
    assert disqualify(ledger, 13, "hardware") == 12 and ledger.disqualified == [12]
    assert healthy_target(root, ledger.disqualified)[0] == 8
    # Negative controls: past the step the last rollback left from, or another cause, or data: nothing disqualified.
    fresh = Ledger(events=[{"step": 14, "rolled_back_to": 12, "cause": "hardware"}])
    assert disqualify(fresh, 15, "hardware") is None
    assert disqualify(fresh, 13, "numerics") is None
    assert disqualify(Ledger(events=[{"step": 14, "rolled_back_to": 12, "cause": "data"}]), 13, "data") is None
    assert fresh.disqualified == [] and healthy_target(root, [])[0] == 12
    assert healthy_target(root, [4]) is None
