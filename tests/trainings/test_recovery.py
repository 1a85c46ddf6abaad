"""Graded response, replay diagnosis, fault scenes and the rollback protocol, on real runs."""

import importlib.metadata
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_trained, run_tiny
from rank_launcher import run_ranks

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg; 0.17+ is held through Megatron-LM's loop (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def ledger(out):
    return json.loads((out / "checkpoints" / "megatron_patches_ledger.json").read_text())


def test_persistent_fault_rolls_back_with_lower_lr_and_blacklist(tmp_path):
    run = run_tiny(tmp_path, "--steps", "20", "--save-interval", "4", "--inject", f"nan:step=10,count=5,param={FC1}")
    result = assert_trained(run)
    assert (result["rollbacks"], result["lr_scale"], result["steps_completed"]) == (1, 0.5, 20)
    warning, error = run.incidents
    assert (warning["step"], warning["severity"], warning["action"]) == (10, "warning", "skip_step")
    assert (error["step"], error["severity"], error["action"]) == (11, "error", "rollback")
    assert error["rolled_back_to"] == 8 and error["lr_scale"] == 0.5
    # The injected NaN is not re-injected on replay: the verdict is transient, the cause hardware, so the
    # samples are innocent: none is blacklisted. The five steps of the fault count once against the device.
    assert error["replay"]["verdict"] == "transient" and error["cause"]["class"] == "hardware"
    assert result["blacklisted_samples"] == [] == ledger(tmp_path)["blacklist"]
    assert ledger(tmp_path)["rollbacks"] == 1 and [e["step"] for e in ledger(tmp_path)["hardware"]] == [10]
    # The restored state is the saved one: step 9 replayed after the rollback gives the same
    # loss, bit for bit, as the first time (step 10 differs: new data, halved learning rate).
    log = result["loss_log"]
    nines = [loss for step, loss in log if step == 9]
    assert len(nines) == 2 and nines[0] == nines[1]
    assert [step for step, _ in log] == list(range(1, 12)) + list(range(9, 21))


def test_poisoned_sample_is_deterministic_blacklisted_and_never_fed_again(tmp_path):
    run = run_tiny(tmp_path, "--steps", "12", "--save-interval", "4", "--inject", "poison:sample=45")
    assert_trained(run)
    (record,) = run.incidents
    assert record["step"] == 6 and record["replay"]["verdict"] == "deterministic"
    assert record["origin_ranks"] == []  # one replica: the origin check is not worth a read there
    # The poison drill is labelled, with the sample it fed.
    assert record["injected"] == [{"drill": "poison:sample=45", "rank": 0, "sample": 45}]
    # Only the micro-batch whose loss went non-finite in the replay is blacklisted.
    assert record["blacklisted"] == [44, 45, 46, 47] == ledger(tmp_path)["blacklist"]
    # Back to step 4 by hand, same poison: sample 45 is skipped, so nothing goes wrong.
    for step in (8, 12):
        subprocess.run(["rm", "-rf", str(tmp_path / "checkpoints" / f"iter_{step:07d}")], check=True)
    again = run_tiny(tmp_path, "--steps", "12", "--resume", "--inject", "poison:sample=45")
    result = assert_trained(again, min_drop=0.0)
    assert result["incidents"] == 0 and result["loss_log"][0][0] == 5
    assert len(run.incidents) == 1  # no new record was appended


def test_a_rollback_that_would_redo_the_last_one_unchanged_stops_instead(tmp_path):
    # Sample 45 (fed at step 6) poisons the loss; no replay, so nothing is blacklisted, and lr_factor 1
    # keeps the learning rate: the redo from step 4 meets the same poison at step 6. A second rollback
    # would compute the same again, so the guard stops there instead of spending its budget of 5.
    config = tmp_path / "guard.yaml"
    config.write_text("response: {persist_steps: 1, replay: false}\n"
                      "recovery: {max_rollbacks: 5, lr_factor: 1.0, blacklist: deterministic}\nscene: {enabled: false}\n")
    run = run_tiny(tmp_path, "--steps", "8", "--save-interval", "4", "--config", str(config),
                   "--inject", "poison:sample=45")
    assert run.returncode == 86, run.output[-3000:]
    first, second = run.incidents
    assert (first["step"], first["action"], first["rolled_back_to"]) == (6, "rollback", 4)
    assert (second["step"], second["severity"], second["action"]) == (6, "critical", "stop")
    assert ("would redo rollback 1 to no purpose: the anomaly came back at step 6 after it, and no sample would be "
            "left out") in second["reason"]
    assert ledger(tmp_path)["rollbacks"] == 1


def test_single_transient_fault_is_a_warning_classified_transient(tmp_path):
    run = run_tiny(tmp_path, "--steps", "12", "--inject", f"inf:step=5,param={FC1}")
    assert_trained(run)
    (record,) = run.incidents
    assert (record["severity"], record["action"], record["replay"]["verdict"]) == ("warning", "skip_step", "transient")
    assert record["blacklisted"] == []


def test_fault_scene_bundle_is_complete(tmp_path):
    run = run_tiny(tmp_path, "--steps", "8", "--inject", f"nan:step=3,param={FC1}")
    assert_trained(run, min_drop=0.0)
    (record,) = run.incidents
    rank_dir = tmp_path / "scenes" / "step0000003" / "rank00000"
    assert record["scene"] == str(rank_dir.parent)
    manifest = json.loads((rank_dir / "MANIFEST.json").read_text())["files"]
    for name, size in manifest.items():
        assert (rank_dir / name).stat().st_size == size
    env = json.loads((rank_dir / "environment.json").read_text())
    # 0.19's package_info adds "+<git hash>" of the working directory's repository to the release.
    assert env["megatron_core"].split("+")[0] == importlib.metadata.version("megatron-core")
    assert env["world"]["size"] == 1
    import torch

    scene = torch.load(rank_dir / "scene.pt", weights_only=False)
    assert scene["batch"]["samples"] == list(range(16, 24))
    assert [t.shape for t in scene["batch"]["tokens"]] == [torch.Size([4, 32])] * 2
    assert scene["grad_norms"][FC1] != scene["grad_norms"][FC1]  # NaN: the bad one
    assert scene["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-3)
    assert {"torch", "tracker", "python"} <= set(scene["rng"])


@pytest.mark.multiproc
def test_faults_on_two_replicas_at_once_are_critical_and_every_rank_exits(tmp_path):
    """Every rank exits with the critical code the config gives it (``response.exit_codes.critical:
    93`` here; 86 by default)."""
    config = tmp_path / "guard.yaml"
    config.write_text("response: {exit_codes: {critical: 93}}\n")
    procs = run_ranks(2, ["--out", str(tmp_path), "--steps", "10", "--save-interval", "2", "--config", str(config),
                          "--inject", f"nan:step=6,param={FC1},rank=0,phase=local",
                          "--inject", "nan:step=6,param=decoder.layers.0.mlp.linear_fc2.weight,rank=1,phase=local"])
    assert [p.returncode for p in procs] == [93, 93], procs[0].stdout[-2000:]
    record = [json.loads(line) for line in (tmp_path / "incidents.jsonl").read_text().splitlines()][-1]
    assert (record["severity"], record["action"]) == ("critical", "stop")
    assert record["origin_ranks"] == [0, 1]
    assert "2 data-parallel replicas" in record["reason"]
    # The last rollback target (4, certified by the clean check of 5) is intact: a restart from it trains to the end.
    resumed = run_tiny(tmp_path, "--steps", "10", "--resume", nproc=2)
    result = assert_trained(resumed, min_drop=0.0)
    assert result["loss_log"][0][0] == 5 and result["incidents"] == 0


@pytest.mark.multiproc
def test_local_fault_on_one_replica_names_its_origin(tmp_path):
    run = run_tiny(tmp_path, "--steps", "10", "--inject", f"nan:step=4,param={FC1},rank=1,phase=local", nproc=2)
    assert_trained(run, min_drop=0.0)
    (record,) = run.incidents
    assert record["ranks_affected"] == [0, 1]  # spread by the all-reduce
    assert record["origin_ranks"] == [1]        # but it entered on rank 1
    assert record["severity"] == "warning"


def test_exit_and_restart_executor(tmp_path):
    spec = f"nan:step=6,count=3,param={FC1}"
    first = run_tiny(tmp_path, "--steps", "12", "--save-interval", "4", "--recovery", "exit", "--inject", spec)
    assert first.returncode == 84, first.output[-2000:]
    state = ledger(tmp_path)
    assert state["rollbacks"] == 1 and state["lr_scale"] == 0.5 and state["spent_injections"] == [spec]
    assert state["blacklist"] == list(range(40, 56))
    second = run_tiny(tmp_path, "--steps", "12", "--save-interval", "4", "--recovery", "exit", "--resume", "--inject", spec)
    result = assert_trained(second, min_drop=0.0)
    assert result["incidents"] == 0 and result["lr_scale"] == 0.5 and result["loss_log"][0][0] == 5


def test_killed_bundle_write_never_reads_as_complete(tmp_path):
    script = (
        "import sys, torch; from megatron_patches.scene import write_bundle\n"
        "write_bundle(sys.argv[1], {'batch': {'tokens': [torch.ones(256, 2**20)]}}, {}, max_bytes=2**40)\n"
    )
    target = tmp_path / "scenes" / "step0000001" / "rank00000"
    proc = subprocess.Popen([sys.executable, "-c", script, str(target)])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".tmp-") for p in target.parent.glob("*")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from megatron_patches.scene import list_complete

    assert list_complete(str(tmp_path)) == []
    assert not target.exists()
    assert any(p.name.startswith(".tmp-") for p in target.parent.iterdir())
