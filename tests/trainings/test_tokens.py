"""Token ids outside the vocabulary (``detectors.tokens``, on by default; issue 40's input target):
fed to one tensor-parallel rank they kill the process in the embedding's lookup; under TP2 megatron-core
masks them into zero vectors and the run trains on silently. Guarded, either is an incident naming the
rank that fed them, and the step is not applied."""

import pytest

from conftest import detectors_config, run_tiny

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

EMBEDDING = "embedding.word_embeddings"


def _config(where, enabled: bool) -> str:
    return detectors_config(where, tokens=enabled)


def test_one_id_outside_the_vocabulary_is_an_incident_where_it_would_have_killed_the_run(tmp_path):
    drill = f"bitflip:step=5,phase=input,module={EMBEDDING},bit=30,scope=element,seed=1234"
    run = run_tiny(tmp_path / "on", "--steps", "8", "--inject", drill, "--config", _config(tmp_path, True))
    assert run.returncode == 0, run.output[-3000:]
    assert f"fired into the token ids fed to {EMBEDDING} on rank 0: changed 1 of 128; 1 outside the vocabulary " \
           "[0, 128)" in run.output
    (record,) = run.incidents
    assert (record["step"], record["kind"], record["action"]) == (5, "vocab", "skip_step")
    assert record["origin_ranks"] == [0] and record["first"]["reasons"] == ["input:vocab"]
    assert record["first"]["name"] == f"{EMBEDDING}.weight"
    assert record["vocab"] == {"ids_outside": 2, "vocab_size": [128]}  # the drill fires in both micro-batches
    assert record["message"].startswith(f"token ids outside the vocabulary fed to {EMBEDDING} on rank 0")
    assert run.result["params_finite"] is True
    # Negative control: without the check the lookup fails and the run is lost.
    off = run_tiny(tmp_path / "off", "--steps", "8", "--inject", drill, "--config", _config(tmp_path, False))
    assert off.returncode != 0 and "index out of range" in off.output, off.output[-3000:]


@pytest.mark.multiproc
def test_under_tp2_ids_megatron_masks_silently_are_named_on_the_rank_that_fed_them(tmp_path):
    drill = f"sign:step=5,phase=input,module={EMBEDDING},rank=1,scope=row,seed=1234"
    args = ("--steps", "8", "--tp", "2", "--inject", drill)
    run = run_tiny(tmp_path / "on", *args, "--config", _config(tmp_path, True), nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["kind"], record["origin_ranks"]) == (5, "vocab", [1])
    assert (record["first"]["name"], record["first"]["ranks"]["global"]) == (f"{EMBEDDING}.weight", 1)
    assert record["message"].endswith("fed by rank(s) [1]")
    # Negative control: megatron-core turns the negative ids into zero vectors; nothing else sees it.
    off = run_tiny(tmp_path / "off", *args, "--config", _config(tmp_path, False), nproc=2)
    assert off.returncode == 0 and off.incidents == [], off.output[-3000:]
