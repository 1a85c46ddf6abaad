"""Incident findings and records without training: ParamFinding, make_record, finite_json and the
JSONL writer against real files, a full device and a vanished directory (incidents.py)."""

import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from megatron_patches.incidents import INCIDENT_SCHEMA, JsonlWriter, ParamFinding, finite_json, finite_or_none, make_record

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


def finding(name, order, rank=0, **fields):
    values = dict(layer=None, shape=[2, 2], nan=0, inf=0, overflow=0, norm=1.0, host="h", device="cpu")
    values.update(fields)
    return ParamFinding(name=name, order=order, ranks={"global": rank, "tp": 0, "pp": 0, "dp": rank}, **values)


def record(params, **fields):
    values = dict(step=4, severity="warning", kind="nan", kinds=["nan"], action="skip_step", message="m",
                  params=params, ranks_affected=[p.ranks["global"] for p in params], world={"size": 2})
    values.update(fields)
    return make_record(**values)


def test_a_finding_defaults_to_no_shard_and_no_reasons():
    found = finding("w", 3)
    assert found.shard is False and found.reasons == []
    assert asdict(found)["ranks"] == {"global": 0, "tp": 0, "pp": 0, "dp": 0}
    assert finding("v", 1).reasons is not found.reasons  # each finding its own list


def test_params_are_ordered_nearest_the_output_first_then_by_rank():
    params = [finding("a", 1, rank=1), finding("c", 9, rank=1), finding("b", 5), finding("c", 9, rank=0)]
    rec = record(params)
    assert [(p["name"], p["ranks"]["global"]) for p in rec["params"]] == [("c", 0), ("c", 1), ("b", 0), ("a", 1)]
    assert rec["first"] == rec["params"][0]


def test_of_a_tensor_found_on_several_ranks_the_one_its_own_rank_flagged_leads():
    # Tensor parallel: peers judges world-wide sums, so both halves of fc1 carry peer_ratio; the
    # z-score of rank 1's own half says where the fault is.
    shared, own = finding("fc1", 9, rank=0, reasons=["peer_ratio"]), finding("fc1", 9, rank=1, reasons=["zscore", "peer_ratio"])
    assert record([shared, own])["first"]["ranks"]["global"] == 1
    both_shared = finding("fc1", 9, rank=1, reasons=["peer_ratio"])
    assert record([both_shared, shared])["first"]["ranks"]["global"] == 0  # nothing local: the lowest rank


def test_the_replay_trace_narrows_origins_shared_by_model_parallel_peers():
    from megatron_patches.incidents import _narrow_to_traced

    rec = {"origin_ranks": [0, 1], "message": "nan gradient ...; entered on rank(s) [0, 1]"}
    _narrow_to_traced(rec, {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [1]})
    assert rec["origin_ranks"] == [1] and rec["origin_ranks_before_trace"] == [0, 1]
    assert rec["message"].endswith("went non-finite first on rank(s) [1] (decoder.layers.1.mlp): the fault entered there")
    for origins, traced in (([1], [1]), ([0, 1], [2]), ([0, 1], None), (None, [1])):
        rec = {"origin_ranks": origins, "message": "m"}
        _narrow_to_traced(rec, {"module": "x", "ranks": traced} if traced else None)
        assert rec == {"origin_ranks": origins, "message": "m"}


def test_a_known_origin_leads_as_first():
    origin = finding("embedding.word_embeddings.weight", 0, rank=1, reasons=["nan"])
    rec = record([finding("output_layer.weight", 9)], first=origin)
    assert rec["first"]["name"] == "embedding.word_embeddings.weight" and rec["first"]["reasons"] == ["nan"]
    assert rec["params"][0]["name"] == "output_layer.weight"


def test_the_record_carries_its_fields_and_extras():
    rec = record([finding("w", 1, rank=1), finding("v", 2, rank=1), finding("u", 0, rank=0)], total_norm=None,
                 batch={"samples": [3]}, origin_ranks=[1])
    assert rec["schema"] == INCIDENT_SCHEMA
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["time"])
    assert (rec["step"], rec["severity"], rec["kind"], rec["kinds"], rec["action"], rec["message"]) == (
        4, "warning", "nan", ["nan"], "skip_step", "m")
    assert rec["ranks_affected"] == [0, 1] and rec["world"] == {"size": 2}
    assert (rec["total_norm"], rec["batch"], rec["origin_ranks"]) == (None, {"samples": [3]}, [1])


def test_a_record_without_findings_has_no_first():
    rec = record([])
    assert rec["first"] is None and rec["params"] == [] and rec["ranks_affected"] == []


def test_an_unknown_severity_is_refused():
    with pytest.raises(ValueError, match="severity must be one of"):
        record([], severity="fatal")


def test_finite_json_turns_every_nan_and_inf_into_null():
    value = {"a": float("nan"), "b": [1.0, float("inf"), (float("-inf"), 2)], "c": {"d": 3, "e": "x"}}
    assert finite_json(value) == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": 3, "e": "x"}}
    assert [finite_or_none(x) for x in (0.0, -1.5, float("nan"), float("inf"))] == [0.0, -1.5, None, None]


# --- the writer -------------------------------------------------------------------------


def lines(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def test_each_write_is_one_compact_line_appended(tmp_path):
    path = tmp_path / "deep" / "incidents.jsonl"  # the directory is made
    writer = JsonlWriter(str(path))
    assert writer.write({"step": 1, "v": [1, 2]}) and writer.write({"step": 2})
    assert path.read_text() == '{"step":1,"v":[1,2]}\n{"step":2}\n'
    assert JsonlWriter(str(path), fsync=False).write({"step": 3})  # another writer appends
    assert [r["step"] for r in lines(path)] == [1, 2, 3] and writer.lost_writes == 0


def test_values_json_has_no_form_for_are_written_as_json_can(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = JsonlWriter(str(path))
    assert writer.write({"norm": float("nan"), "t": torch.tensor([1.5, 2.0]), "s": {3}, "tu": (1, 2),
                         "other": object.__new__(type("Thing", (), {"__str__": lambda self: "thing"}))})
    (written,) = lines(path)
    assert written == {"norm": None, "t": [1.5, 2.0], "s": [3], "tu": [1, 2], "other": "thing"}


def test_a_full_device_costs_records_never_an_exception(guard_log):
    writer = JsonlWriter("/dev/full", warn_every=2, warn_interval_s=3600)
    with guard_log.at_level(logging.WARNING, logger="megatron_patches"):
        assert [writer.write({"step": s}) for s in range(4)] == [False] * 4
    assert writer.lost_writes == 4
    warned = [r.getMessage() for r in guard_log.records if "cannot write to /dev/full" in r.getMessage()]
    assert len(warned) == 2  # the first loss, then once per warn_every losses
    assert "1 record(s) lost so far" in warned[0] and "3 record(s) lost so far" in warned[1]


def test_strict_raises_what_the_file_system_said():
    with pytest.raises(OSError):
        JsonlWriter("/dev/full", strict=True).write({"step": 1})


def test_a_directory_removed_under_the_writer_is_made_again(tmp_path):
    directory = tmp_path / "reports"
    writer = JsonlWriter(str(directory / "incidents.jsonl"))
    assert writer.write({"step": 1})
    (directory / "incidents.jsonl").unlink()
    directory.rmdir()
    blocker = tmp_path / "reports"
    blocker.write_text("")  # a file where the directory was: this write is lost
    assert writer.write({"step": 2}) is False and writer.lost_writes == 1
    blocker.unlink()
    assert writer.write({"step": 3}) is True  # the directory is made again
    assert [r["step"] for r in lines(directory / "incidents.jsonl")] == [3]


_CUT = """
import os, resource, signal, sys
from megatron_patches.incidents import JsonlWriter
path = sys.argv[1]
with open(path, "w") as handle:
    handle.write('{"step":1}\\n')
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG instead of a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (40, resource.RLIM_INFINITY))
writer = JsonlWriter(path)
print(writer.write({"step": 2, "pad": "x" * 200}), writer.lost_writes)
"""


def test_a_line_cut_off_by_a_full_disk_is_removed_so_the_file_stays_whole(tmp_path):
    path = tmp_path / "incidents.jsonl"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _CUT, str(path)], capture_output=True, text=True, timeout=60,
                          cwd=repo, env={**os.environ, "PYTHONPATH": repo})
    assert proc.stdout.split() == ["False", "1"], proc.stderr
    assert path.read_text() == '{"step":1}\n'
