"""Megatron-LM's loop names where a gradient fault entered: the parameter at Megatron's iteration,
the rank's own gradient before the reduction (overlapped or not, with Megatron's check on or off),
Megatron's bucket norms, and the guard's counters in Megatron's writers."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    FC1, Loop, loop_kind, megatron_lm_checkout, _packaged_loop_available, make_loop, guard_env, iterations,
    incidents)


@pytest.mark.multiproc
def test_pretrain_gpt_names_the_parameter_at_megatrons_iteration(loop_kind, request, tmp_path):
    """One run, three readers: the incident record and the fault scene, Megatron's iteration log,
    and the guard's series in Megatron's TensorBoard and W&B writers (W&B offline: nothing leaves
    the machine; left out where wandb is not installed)."""
    loop = make_loop(loop_kind, request, tmp_path, only=None)  # a checkout: the full source patch
    tensorboard = tmp_path / "tb"
    env = guard_env(tmp_path, inject=[f"nan:step=3,param={FC1}"])
    wandb = importlib.util.find_spec("wandb") is not None
    if wandb:
        env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    proc = loop.run(env, "--tensorboard-dir", str(tensorboard), *(
        ["--wandb-project", "guard-ci", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wandb")]
        if wandb else []))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]

    [incident] = incidents(tmp_path)
    assert incident["step"] == 3 and incident["kind"] == "nan" and incident["action"] == "skip_step"
    assert incident["first"]["name"] == FC1 and incident["first"]["layer"] == 1
    # Iteration 3 as Megatron logs it; global batch 4, so samples 8..11 of the training set.
    assert incident["batch"] == {"iteration": 3, "consumed_train_samples": 8, "samples": [8, 9, 10, 11]}
    # Each rank's fault scene holds its own half of the batch: data-parallel rank 1 read 10 and 11.
    import torch

    from megatron_patches.scene import scene_dir

    scene = torch.load(Path(scene_dir(str(tmp_path / "reports"), 3, 1)) / "scene.pt", weights_only=False)
    assert {k: scene["batch"][k] for k in ("iteration", "consumed_train_samples", "samples")} == {
        "iteration": 3, "consumed_train_samples": 8, "samples": [10, 11]}
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "number of skipped iterations:   1" in logged[3]
    # A skipped iteration logs no loss; from 0.17 on the loop logs it as 0.
    assert ("lm loss: 0.000000E+00" in logged[3]) if loop.version >= (0, 17) else ("lm loss" not in logged[3])
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (4, 5, 6)]
    assert all(loss == loss and loss < 100 for loss in losses), losses

    writers = {}
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tensorboard))
        events.Reload()
        writers["tensorboard"] = {tag: {e.step: e.value for e in events.Scalars(tag)}
                                  for tag in events.Tags()["scalars"]}
    if wandb:
        [run_file] = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
        series: dict[str, dict[int, float]] = {}
        for row in wandb_history(run_file):
            for key, value in row.items():
                if key.startswith("megatron_patches/"):
                    series.setdefault(key, {})[row["_step"]] = value
        writers["wandb"] = series
    for name, scalars in writers.items():
        assert scalars["megatron_patches/incidents"] == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}, name
        assert scalars["megatron_patches/skipped_steps"][3] == 1, name
        assert sorted(scalars["megatron_patches/total_grad_norm"]) == [1, 2, 4, 5, 6], name  # none for the NaN step
    if len(writers) < 2:  # the test extras install both; say so where one is missing
        pytest.skip(f"checked the record and the log, and only {sorted(writers)} of tensorboard, wandb (not installed)")


def wandb_history(run_file: Path) -> list[dict]:
    """The ``history`` rows of an offline W&B run file, read directly: the file is a LevelDB-style
    log (a 7-byte W&B header, then 32 KiB blocks of records, each with a 7-byte header: checksum,
    length, type FULL/FIRST/MIDDLE/LAST) of serialized ``wandb_internal_pb2.Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, header = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", run_file
    records, pending, offset = [], b"", header
    while offset + header <= len(data):
        if block - offset % block < header:  # too little room left in this block: padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + header])
        payload = data[offset + header:offset + header + length]
        offset += header + length
        if kind == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows



def one_off_local_nan(loop: Loop, tmp_path: Path, *extra: str, megatrons_check: bool = True) -> tuple[str, dict]:
    """Stock flags (Megatron's pre-reduction NaN check on, --rerun-mode validate_results), 2 ranks,
    one NaN in rank 1's own fc1 gradient at iteration 4: the run must end 0 with one incident.
    ``megatrons_check`` False: ``extra`` turns Megatron's check off; the guard's own fused pass
    before the reduction finds the origin (nothing logged then until the incident)."""
    env = guard_env(tmp_path, inject=[f"nan:step=4,rank=1,phase=local,param={FC1}"])
    proc = loop.run(env, *extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    if megatrons_check:
        # Megatron's rerun machine reran the step in place and called it transient; not fatal, so no
        # exit 17: its verdict is the record's.
        assert "Need to rerun step" in output and "Possible transient error" in output
        assert "Continuing normal execution because failed validation was not fatal" in output
        assert re.search(rf"before the data-parallel reduction: non-finite local gradient on rank 1 .*{FC1}", output)
    else:  # nothing of Megatron's looked at the gradients: no rerun
        assert "Need to rerun step" not in output and "Possible transient error" not in output
    [incident] = incidents(tmp_path)
    assert incident["step"] == 4 and incident["kind"] == "nan" and incident["action"] == "skip_step"
    assert incident["first"]["name"] == FC1 and incident["origin_ranks"] == [1]
    assert incident["severity"] == "warning"  # one origin: below critical
    if megatrons_check:
        assert incident["megatron_rerun"]["verdict"] == "transient"
        [rerun] = incident["megatron_rerun"]["by_rank"]
        assert rerun["rank"] == 1 and rerun["check"] == "bucket norm" and rerun["mode"] == "validate_results"
    else:
        assert "megatron_rerun" not in incident
    assert "loss_nonfinite" not in incident and "all_gradients_nonfinite" not in incident
    # Named where Megatron's bucket check found it: on rank 1, before the reduction spread it.
    [before] = incident["pre_reduction"]
    assert before["name"] == FC1 and before["nan"] == 1 and before["layer"] == 1
    assert before["ranks"]["global"] == 1 and before["ranks"]["dp"] == 1
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "number of skipped iterations:   1" in logged[4]
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (5, 6)]
    assert all(loss == loss and loss < 100 for loss in losses), losses
    return output, incident


@pytest.mark.multiproc
def test_stock_flags_local_nan_on_one_rank_is_the_guards_incident_not_megatrons_exit(loop_kind, request, tmp_path):
    """The bucket check finds rank 1's NaN before the reduction; the guard names it, skips the
    step and the job runs to its last iteration instead of Megatron's rerun machine ending it with 17."""
    one_off_local_nan(make_loop(loop_kind, request, tmp_path, only="pretrain"), tmp_path)


@pytest.mark.multiproc
def test_overlapped_reduction_local_nan_is_named_at_its_bucket_with_one_origin(loop_kind, request, tmp_path):
    """--overlap-grad-reduce: buckets are reduced during backward, before finalize_model_grads. The
    drill and the origin flag go in at the bucket's check, before its collective: one origin,
    graded below critical; after the reduce-scatter the NaN sits in its owner's shard."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    _, incident = one_off_local_nan(loop, tmp_path, "--overlap-grad-reduce", "--use-distributed-optimizer")
    assert all(p["shard"] for p in incident["params"])


@pytest.mark.multiproc
def test_a_finite_local_gradient_whose_norm_overflows_is_an_origin(loop_kind, request, tmp_path, monkeypatch):
    """Rank 1's fc1 gradient with the high exponent bit set in every element: finite values of 2^64
    and more, whose squares overflow Megatron's float32 bucket norm (Inf). Megatron reruns the step
    in place and gets clean gradients; without the guard naming the overflow there, the check
    before clipping saw nothing and the fault left no record (the negative control)."""
    drill = f"bitflip:step=4,rank=1,phase=local,param={FC1},bit=exponent_high,scope=all"
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    (tmp_path / "named").mkdir()
    (tmp_path / "unnamed").mkdir()
    output = loop.run(guard_env(tmp_path / "named", inject=[drill])).stdout
    assert "overflowing (finite, squares past float32) local gradient on rank 1" in output, output[-4000:]
    [incident] = incidents(tmp_path / "named")
    assert (incident["step"], incident["kind"], incident["action"]) == (4, "overflow", "skip_step")
    assert incident["origin_ranks"] == [1] and incident["first"]["name"] == FC1
    [before] = incident["pre_reduction"]
    assert before["ranks"]["global"] == 1 and before["overflow"] > 0 and before["reasons"] == ["overflow"]
    from megatron_patches.seams import bucket_norms

    monkeypatch.setattr(bucket_norms, "overflowed_params", lambda chunks, group: [])
    proc = loop.run(guard_env(tmp_path / "unnamed", inject=[drill]))
    assert proc.returncode == 0 and "Possible transient error" in proc.stdout
    assert incidents(tmp_path / "unnamed") == []


@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop_available(), reason="the installed megatron-core ships no megatron/training")
def test_a_finite_fault_in_one_replicas_gradient_is_named_there_from_megatrons_bucket_norms(tmp_path, monkeypatch):
    """Stock flags, DP2: Megatron's bucket check stands in for the guard's own pass before the
    reduction (no extra read), so no per-parameter norm of rank 1's own gradient is taken. Rank 1's
    fc1 gradient x1,000 at iteration 24 (after history's 20-step warm-up): its bucket norm against
    its running mean names rank 1 as the origin; without it (the negative control) the reduced
    gradient is flagged with no origin, named first on the rank that holds it."""
    loop = Loop(None)
    drill = f"scale:step=24,rank=1,phase=local,param={FC1},factor=1000,scope=all"
    for name in ("named", "unnamed"):
        (tmp_path / name).mkdir()
        proc = loop.run(guard_env(tmp_path / name, inject=[drill]), "--train-iters", "25")
        assert proc.returncode == 0, proc.stdout[-4000:]
        [incident] = incidents(tmp_path / name)
        assert incident["step"] == 24 and incident["first"]["name"] == FC1
        if name == "named":
            assert incident["origin_ranks"] == [1], incident["message"]
            from megatron_patches.seams import origin

            monkeypatch.setattr(origin.OriginWatch, "note_bucket_norms", lambda self, group, norms, step: None)
        else:
            assert incident["origin_ranks"] == [], incident["message"]


GPU_OVERLAP_FLAGS = ("--overlap-grad-reduce", "--use-distributed-optimizer", "--bf16",
                     "--no-check-for-nan-in-loss-and-grad")
"""What GPU users run: reductions overlapped with backward, Megatron's own NaN check off."""


@pytest.mark.multiproc
def test_overlapped_reduction_without_megatrons_check_names_one_origin(loop_kind, request, tmp_path):
    """Megatron's check off, reductions overlapped: each bucket group's reduction starts during
    backward, long before finalize_model_grads. The drill and the origin flag (one fused pass over
    the group's own gradients) go in at the group's start_grad_sync, before its collective: one
    origin, graded warning, the parameter named on dp 1."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    _, incident = one_off_local_nan(loop, tmp_path, *GPU_OVERLAP_FLAGS, megatrons_check=False)
    reached_the_optimizer(incident)


def reached_the_optimizer(incident: dict) -> None:
    """The drill went in before the collective: the reduce-scatter carried the NaN into its owner's
    shard, where the optimizer found it. (A drill after the collective started leaves it in a
    buffer the reduction no longer reads: an incident from the origin read alone, no params.)"""
    assert [p["name"] for p in incident["params"]] == [FC1] and all(p["shard"] for p in incident["params"])


@pytest.mark.multiproc
def test_overlapped_param_gather_without_megatrons_check_names_one_origin(loop_kind, request, tmp_path):
    """The same with --overlap-param-gather (the next step's parameters are gathered during its
    forward): the reduction side goes through the same start_grad_sync."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    _, incident = one_off_local_nan(loop, tmp_path, *GPU_OVERLAP_FLAGS, "--overlap-param-gather",
                                    megatrons_check=False)
    reached_the_optimizer(incident)


@pytest.mark.multiproc
def test_interleaved_overlapped_reduction_without_megatrons_check_names_one_origin(loop_kind, request, tmp_path):
    """Interleaved pipeline (PP 2 x VPP 2) over two data-parallel replicas, 4 ranks: the schedule
    starts each model chunk's reduction through grad_sync_func in the middle of the pipeline's
    backward. Rank 1 (pp 0, dp 1) holds global layer 2 in its second chunk; its NaN goes in before
    that chunk's collective: one origin, warning, the reduce-scatter carries it into the owner's
    shard."""
    name = "decoder.layers.2.mlp.linear_fc1.weight"
    loop = replace(make_loop(loop_kind, request, tmp_path, only="pretrain"), nproc=4)
    env = guard_env(tmp_path, inject=[f"nan:step=3,rank=1,phase=local,param={name}"])
    proc = loop.run(env, *GPU_OVERLAP_FLAGS, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["severity"]) == (3, "skip_step", "warning")
    assert incident["origin_ranks"] == [1]
    [before] = incident["pre_reduction"]
    assert (before["name"], before["layer"], before["ranks"]["global"], before["ranks"]["pp"]) == (name, 2, 1, 0)
    assert [p["name"] for p in incident["params"]] == [name] and all(p["shard"] for p in incident["params"])
    assert sorted(iterations(output)) == [1, 2, 3, 4, 5, 6]
