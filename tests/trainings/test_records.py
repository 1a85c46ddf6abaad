"""Incident records are exact values: `injected` names only the drills that fired, the scene writer
works on its own copy, and every episode of a repeated step keeps its scene."""

import json

import pytest
import torch

from conftest import run_tiny
from megatron_patches.inject import Injector, parse_spec

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg; 0.17+ is held through Megatron-LM's loop (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def grads():
    return [(FC1, 22, torch.zeros(4)), ("decoder.layers.0.mlp.linear_fc2.weight", 10, torch.zeros(4))]


def test_injected_lists_only_drills_that_fired_on_this_rank_with_their_parameter():
    drill = f"nan:step=3,count=3,rank=1,param={FC1}"
    elsewhere = "inf:step=3,param=no.such.parameter"
    injector = Injector([parse_spec(drill), parse_spec(elsewhere)])
    # Rank 0: the drill's window covers step 3 but it is rank 1's; the other matches nothing.
    assert injector.apply(3, "grad", 0, grads()) == []
    assert injector.fired_at(3) == []
    rank1 = Injector([parse_spec(drill), parse_spec(elsewhere)])
    rank1.apply(3, "grad", 1, grads())
    assert rank1.fired_at(3) == [{"drill": drill, "rank": 1, "param": FC1}]
    assert rank1.fired_at(4) == []  # step 4 is in the window but has not fired (yet)
    # Spent after a restart (read from the ledger): nothing fired in this process, nothing labelled.
    rank1.spend([drill])
    assert rank1.apply(4, "grad", 1, grads()) == [] and rank1.fired_at(4) == []
    rank1.forget_before(4)
    assert rank1.fired_at(3) == []


def test_poison_drill_is_labelled_when_its_sample_is_fed():
    where = {"step": 6, "rank": 1}
    injector = Injector([parse_spec("poison:sample=45")], clock=lambda: (where["step"], where["rank"]))
    assert injector.poisoned([40, 41, 42, 43]) == set() and injector.fired_at(6) == []
    assert injector.poisoned([44, 45, 46, 47]) == {45}
    assert injector.poisoned([44, 45, 46, 47]) == {45}  # fed again (a replay): still one entry
    assert injector.fired_at(6) == [{"drill": "poison:sample=45", "rank": 1, "sample": 45}]


def test_real_fault_while_a_drill_is_configured_is_not_labelled_injected(tmp_path):
    # Step 4's total gradient norm (1.71) is over the limit: a real, uninjected finding. The drill is
    # configured and has a target (a drill for a rank the job lacks is now refused at start, issue
    # 25), but its steps 5-6 come after this 4-step run: it never fires.
    config = tmp_path / "guard.yaml"
    config.write_text("detectors:\n  magnitude:\n    total_norm_max: 1.6\n")
    run = run_tiny(tmp_path / "out", "--steps", "4", "--config", str(config),
                   "--inject", f"nan:step=5,count=2,param={FC1}")
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["kind"]) == (4, "magnitude"), record
    assert record["injected"] == []
    assert run.result["monitor"]["injected"] == 0
    text = __import__("subprocess").run([__import__("sys").executable, "-m", "megatron_patches", "report",
                                         str(tmp_path / "out")], capture_output=True, text=True).stdout
    assert "injected" not in text, text


class Gate:
    """Holds the scene writer's thread inside ``torch.save`` until the test opens it."""

    def __init__(self, event):
        self.event = event

    def __reduce__(self):
        self.event.wait(30)
        return (int, (0,))


def test_scene_writer_keeps_the_record_as_submitted(tmp_path):
    import threading

    from megatron_patches.scene import SceneWriter

    writer = SceneWriter(queue_size=4)
    gate = threading.Event()
    writer.submit(str(tmp_path / "first" / "rank00000"), {"gate": Gate(gate)})
    record = {"step": 3, "params": [{"name": FC1}], "scene": None}
    writer.submit(str(tmp_path / "second" / "rank00000"), {}, {"incident.json": record})
    # The training thread goes on with its own dict while the writer is busy.
    record["scene"] = "elsewhere"
    record["params"][0]["name"] = "changed"
    record["replay"] = {"verdict": "transient"}
    gate.set()
    writer.close()
    assert writer.written == 2 and writer.failed == 0
    written = json.loads((tmp_path / "second" / "rank00000" / "incident.json").read_text())
    assert written == {"step": 3, "params": [{"name": FC1}], "scene": None}


def test_scene_incident_is_the_complete_record(tmp_path):
    # Replay on: the record waits for the verdict; the scene's copy must carry it too.
    run = run_tiny(tmp_path, "--steps", "5", "--inject", f"nan:step=3,param={FC1}")
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert record["replay"]["verdict"] == "transient"
    scene = json.loads((tmp_path / "scenes" / "step0000003" / "rank00000" / "incident.json").read_text())
    assert scene == record
    assert record["scene"] == str(tmp_path / "scenes" / "step0000003")


def test_same_step_after_a_rollback_keeps_both_episodes_scenes(tmp_path):
    # Sample 45 (fed at step 6) poisons the loss; with no replay nothing is blacklisted, so the
    # rollback to step 4 meets it again at step 6: two episodes of step 6, then the budget is spent.
    config = tmp_path / "guard.yaml"
    config.write_text("response:\n  persist_steps: 1\n  replay: false\n"
                      "recovery:\n  max_rollbacks: 1\n  blacklist: deterministic\n")
    out = tmp_path / "out"
    run = run_tiny(out, "--steps", "8", "--save-interval", "4", "--config", str(config),
                   "--inject", "poison:sample=45")
    assert run.returncode == 86, run.output[-3000:]
    first, second = run.incidents
    assert (first["step"], first["action"], second["step"], second["action"]) == (6, "rollback", 6, "stop")
    assert first["scene"] == str(out / "scenes" / "step0000006")
    assert second["scene"] == str(out / "scenes" / "step0000006-r1")
    for record in (first, second):
        rank_dir = out / "scenes" / record["scene"].rsplit("/", 1)[1] / "rank00000"
        assert json.loads((rank_dir / "incident.json").read_text()) == record
        assert (rank_dir / "MANIFEST.json").is_file()
