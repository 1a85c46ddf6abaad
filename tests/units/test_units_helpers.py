"""The small shared helpers without training: check rotation, layer-slot names, atomic writes,
rank and world outside torch.distributed, an incident's log line."""

import json
import os
import stat

import pytest
import torch

from megatron_patches import collectives, files, incidents, naming
from megatron_patches.detectors import Rotation
from megatron_patches.incident_text import one_line

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


def test_rotation_judges_every_interval_th_check_from_the_first():
    assert [c for c in range(1, 11) if Rotation(interval=3).due(c)] == [1, 4, 7, 10]
    assert all(Rotation().due(c) for c in range(1, 5))


def test_rotation_covers_every_tensor_once_per_period_of_judged_checks():
    rotation = Rotation(interval=2, fraction=0.25)
    assert rotation.period == 4
    judged = [c for c in range(1, 17) if rotation.due(c)]
    assert [rotation.turn(c) for c in judged] == [0, 1, 2, 3, 0, 1, 2, 3]
    covered = [[i for i in range(10) if rotation.covers(i, c)] for c in judged[:4]]
    assert covered == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


@pytest.mark.parametrize("fraction, period", [(1.0, 1), (0.5, 2), (0.3, 3), (0.0625, 16), (0.9, 1)])
def test_rotation_period_is_the_nearest_whole_share(fraction, period):
    assert Rotation(fraction=fraction).period == period
    if period == 1:
        assert all(Rotation(fraction=fraction).covers(i, 5) for i in range(4))


def test_slot_names_are_layers_then_embedding_then_output():
    assert naming.slot_names(5) == ["0", "1", "2", "embedding", "output"]
    assert naming.slot_names(4, layer_prefix="layer ") == ["layer 0", "layer 1", "embedding", "output"]
    assert naming.slot_names(2) == ["embedding", "output"]
    with pytest.raises(IndexError):
        naming.slot_name(5, 5)


@pytest.mark.parametrize("name, layer, slot", [
    ("decoder.layers.2.mlp.linear_fc1.weight", 2, 2),
    ("embedding.word_embeddings.weight", None, 4),
    ("embedding.position_embeddings.weight", None, 4),
    ("decoder.final_layernorm.weight", None, 5),
    ("output_layer.weight", None, 5),
    ("mtp.layers.4.weight", 4, 5),  # a layer index past the transformer layers: output side
])
def test_slot_index_puts_each_parameter_in_its_slot(name, layer, slot):
    info = naming.ParamInfo(name=name, layer=layer, order=0, counts_in_norm=True)
    assert naming.slot_index(info, num_layers=4) == slot
    assert naming.slot_name(slot, 6) == (str(layer) if slot < 4 else ["embedding", "output"][slot - 4])


def test_a_parameter_carries_the_virtual_pipeline_rank_of_its_own_chunk():
    """Two model chunks (an interleaved schedule): each parameter is named with its chunk's
    virtual rank, whatever rank_info says is running now."""
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    infos = naming.name_parameters(chunks, None)
    running = {"global": 0, "tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0, "vpp": 0}
    assert [incidents.param_ranks(running, infos[id(p)])["vpp"] for c in chunks for p in c.parameters()] == [0, 0, 1, 1]
    assert incidents.param_ranks(running, None) == running


def test_rank_and_world_without_torch_distributed():
    assert (collectives.rank(), collectives.world_size()) == (0, 1)
    assert collectives.gather_to_zero({"a": 1}) == [{"a": 1}]
    assert collectives.broadcast_from_zero("x") == "x"


def test_write_text_atomic_replaces_whole_and_honours_the_mode(tmp_path):
    path = tmp_path / "config.yaml"
    files.write_text_atomic(str(path), "a: 1\n")
    files.write_text_atomic(str(path), "a: 2\n")
    assert path.read_text() == "a: 2\n" and os.listdir(tmp_path) == ["config.yaml"]
    private = tmp_path / "private.yaml"
    files.write_text_atomic(str(private), "token: x\n", mode=0o600)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


def test_write_json_atomic_that_fails_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    files.write_json_atomic(str(path), {"a": 1}, indent=1)
    assert json.loads(path.read_text()) == {"a": 1} and "\n" in path.read_text()
    with pytest.raises(TypeError):
        files.write_json_atomic(str(path), {"a": object()})
    with pytest.raises(ValueError):
        files.write_json_atomic(str(path), _circular())
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["state.json"]


def _circular():
    loop: list = []
    loop.append(loop)
    return loop


def test_atomic_directory_appears_only_when_complete(tmp_path):
    target = tmp_path / "scenes" / "step_3"
    with files.atomic_directory(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").close()
        assert not target.exists()
    assert os.listdir(target) == ["a.json"]
    with pytest.raises(RuntimeError):
        with files.atomic_directory(str(target)) as tmp:
            open(os.path.join(tmp, "b.json"), "w").close()
            raise RuntimeError("disk full")
    assert os.listdir(target) == ["a.json"]  # the old one stays, the half-written one is gone
    assert os.listdir(tmp_path / "scenes") == ["step_3"]


def test_the_log_line_names_where_it_was_first_seen_unless_the_message_does():
    rec = {"step": 3, "severity": "error", "kind": "nan", "message": "nan gradient", "action": "rollback",
           "first": {"name": "decoder.layers.1.mlp.linear_fc1.weight", "ranks": {"global": 1}}}
    assert one_line(rec) == ("step 3 error nan: nan gradient (first: decoder.layers.1.mlp.linear_fc1.weight on "
                             "rank 1); action rollback")
    rec["message"] = "nan gradient first at decoder.layers.1.mlp.linear_fc1.weight"
    assert one_line(rec) == f"step 3 error nan: {rec['message']}; action rollback"
    assert one_line({}) == "step - - -: no message; action None"
