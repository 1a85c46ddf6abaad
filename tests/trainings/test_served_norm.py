"""With ``serve_norm: true`` Megatron's clipping norm comes from the guard's own checked pass
(megatron_patches.seams.served_norm): the value Megatron's own code would give, without Megatron reading
the gradients a second time. By default Megatron computes it, and a guarded run equals an unguarded
one bit for bit."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import Run, assert_trained, run_forked, run_packaged_loop
from megatron_patches.testing import step_probe
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS
from megatron_lm_loop import _packaged_loop_available

AUDIT = Path(__file__).resolve().parents[1] / "norm_audit.py"
ITERATION = re.compile(r"iteration\s+(\d+)/.*?(lm loss: \S+).*?(grad norm: \S+)")


SERVING = "serve_norm: true\n"


def run_audited(out: Path, *args: str, nproc: int = 1, config: str | None = SERVING,
                min_drop: float = 0.0) -> tuple[dict, list[dict]]:
    """Train with tests/norm_audit.py (the harness, Megatron's norm computation watched) under the
    guard config ``config`` (YAML text; default: serving the norm); asserts it trained (loss fell
    by ``min_drop``) and returns result.json and each rank's audit."""
    if config is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "guard.yaml").write_text(config)
        args = (*args, "--config", str(out / "guard.yaml"))
    def audit() -> int:  # each rank in a fork of this process (conftest.run_forked): no start-up
        import norm_audit

        sys.argv = [str(AUDIT), "--out", str(out), *args]
        return norm_audit.main()

    run = Run(*run_forked(audit, nproc=nproc), out)
    result = assert_trained(run, min_drop=min_drop)
    audits = [json.loads((out / f"norm_audit.rank{r}.json").read_text()) for r in range(nproc)]
    return result, audits


def assert_served_every_step(result: dict, audits: list[dict], steps: int) -> None:
    """Every step's norm came from the guard on every rank, equal to what Megatron's own code gives
    for the same gradients within 1e-6 relative, and Megatron never read the gradients for it."""
    assert result["monitor"]["served_norms"] == steps, result["monitor"]
    for rank, audit in enumerate(audits):
        assert audit["stock_calls"] == [], (rank, audit)
        assert [s for s, _, _ in audit["served"]] == list(range(1, steps + 1)), (rank, audit)
        for step, ours, stock in audit["served"]:
            assert abs(ours - stock) <= 1e-6 * abs(stock), (rank, step, ours, stock)


# fp16 from 2^16: Megatron's 2^32 would spend these six steps calibrating, serving no norm.
@pytest.mark.parametrize("args", [[], ["--precision", "bf16"], ["--precision", "fp16", "--initial-loss-scale", "65536"]],
                         ids=["fp32", "bf16", "fp16"])
def test_single_rank_norm_served(tmp_path, args):
    result, audits = run_audited(tmp_path, "--steps", "6", *args)
    assert_served_every_step(result, audits, steps=6)


# Two ranks in each layout: tests/trainings/test_training.py::test_parallel_layouts_train_and_the_guard_serves_megatrons_norm.


def test_unchecked_steps_compute_the_norm_as_stock(tmp_path):
    """check_interval 2: the guard serves the checked (even) steps; on the others Megatron computes
    the norm itself, once per step."""
    result, (audit,) = run_audited(tmp_path / "out", "--steps", "6", config=SERVING + "check_interval: 2\n")
    assert result["monitor"]["checked_steps"] == 3 and result["monitor"]["served_norms"] == 3
    assert audit["stock_calls"] == [1, 3, 5], audit
    assert [s for s, _, _ in audit["served"]] == [2, 4, 6], audit
    for step, ours, stock in audit["served"]:
        assert abs(ours - stock) <= 1e-6 * abs(stock), (step, ours, stock)


def test_without_the_guard_megatron_computes_every_norm(tmp_path):
    result, (audit,) = run_audited(tmp_path, "--steps", "3", "--no-guard", config=None)
    assert result["monitor"] is None
    assert audit == {"stock_calls": [-1, -1, -1], "served": []}


def test_a_skipped_step_serves_nothing_stale(tmp_path):
    """The guard skips step 3 (a NaN gradient): no norm is asked for there, and the next step's
    norm is that step's own, served once more."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    result, (audit,) = run_audited(tmp_path, "--steps", "5", "--inject", f"nan:step=3,param={name}")
    assert result["skipped_steps"] == 1 and result["monitor"]["served_norms"] == 4
    assert audit["stock_calls"] == [], audit
    assert [s for s, _, _ in audit["served"]] == [1, 2, 4, 5], audit
    for step, ours, stock in audit["served"]:
        assert abs(ours - stock) <= 1e-6 * abs(stock), (step, ours, stock)


def test_by_default_megatron_computes_every_norm_under_the_guard(tmp_path):
    """``serve_norm`` off (the default): the guard checks every step, Megatron computes its own
    norm on every one of them."""
    result, (audit,) = run_audited(tmp_path, "--steps", "3", config="")
    assert result["monitor"]["checked_steps"] == 3 and result["monitor"]["served_norms"] == 0
    assert audit == {"stock_calls": [1, 2, 3], "served": []}


@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop_available(), reason="megatron-core ships megatron/training from 0.17 on")
@pytest.mark.parametrize("layout", [
    ("--bf16", "--use-distributed-optimizer"),
    # fp16, fp32 and PP2 in make test-all (slow): CI keeps one layout per seam (distopt, TP, EP)
    pytest.param(("--fp16", "--initial-loss-scale", "65536", "--use-distributed-optimizer"), marks=pytest.mark.slow),
    pytest.param((), marks=pytest.mark.slow),  # fp32, plain DDP
    pytest.param(("--use-distributed-optimizer",), marks=pytest.mark.slow),  # fp32 shards
    ("--bf16", "--tensor-model-parallel-size", "2"),
    pytest.param(("--bf16", "--pipeline-model-parallel-size", "2"), marks=pytest.mark.slow),
    ("--bf16", "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
     "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall"),
    # The precision-aware optimizer with the stand-in FusedAdam (megatron_patches.testing.fused_adam).
    ("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
     "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"),
    pytest.param(("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer"), marks=pytest.mark.slow),
    ("--bf16", "--context-parallel-size", "2"),  # the stand-in CP attention (megatron_patches.testing.context_parallel)
    ("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
     "--optimizer-offload-fraction", "0.5", "--no-pin-cpu-grads", "--no-pin-cpu-params"),
    ("--use-torch-fsdp2", "--untie-embeddings-and-output-weights"),
    ("--use-megatron-fsdp", "--no-gradient-reduce-div-fusion", "--ckpt-format", "fsdp_dtensor"),
], ids=["dp2-bf16-distopt", "dp2-fp16-distopt", "dp2-fp32", "dp2-fp32-distopt", "tp2-bf16", "pp2-bf16", "moe-ep2-bf16",
        "dp2-precision-aware-bf16-states", "dp2-precision-aware", "cp2-bf16", "dp2-cpu-offload-half", "dp2-torch-fsdp2",
        "dp2-megatron-fsdp"])
def test_a_guarded_megatron_lm_run_equals_an_unguarded_one_bit_for_bit(tmp_path, layout):
    """Megatron-LM's packaged loop on 2 ranks, 20 iterations, the same seed: with the guard
    (default config) and without it (the runner's --no-guard) every iteration's loss and grad
    norm are the same to the digits Megatron prints, and every rank's weights and optimizer state
    the same to the bit after every iteration (SHA-256, megatron_patches.testing.step_probe). With
    serve_norm on, 14 of the first 20 bf16 DP2 losses differed."""
    _guarded_equals_unguarded(tmp_path, layout, nproc=2)


@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop_available(), reason="megatron-core ships megatron/training from 0.17 on")
@pytest.mark.parametrize("layout", [("--bf16",), pytest.param((), marks=pytest.mark.slow)], ids=["bf16", "fp32"])
def test_a_guarded_one_rank_run_equals_an_unguarded_one_bit_for_bit(tmp_path, layout):
    _guarded_equals_unguarded(tmp_path, layout, nproc=1)


def _guarded_equals_unguarded(tmp_path, layout: tuple, nproc: int) -> None:
    config = tmp_path / "guard.yaml"
    config.write_text(f"report_dir: {tmp_path / 'reports'}\n")
    fsdp = bool({"--use-torch-fsdp2", "--use-megatron-fsdp"} & set(layout))  # Megatron wants > 1 connection there
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(config),
           "CUDA_DEVICE_MAX_CONNECTIONS": "8" if fsdp else "1"}
    lines, outputs = {}, {}
    probes = {}
    for mode in ((), ("--no-guard",)):
        probes[mode] = tmp_path / f"probe{len(mode)}"
        code, output = run_packaged_loop({**env, step_probe.ENV: str(probes[mode])},
                                         [*TINY_GPT_ARGS, "--train-iters", "20", *layout, *mode], nproc=nproc)
        assert code == 0, output[-4000:]
        outputs[mode], lines[mode] = output, ITERATION.findall(output)
    assert "[megatron_patches] guarding megatron-core" in outputs[()]
    assert "[megatron_patches]" not in outputs[("--no-guard",)]
    assert len(lines[()]) == 20 and lines[()] == lines[("--no-guard",)], lines
    # Every bit of every rank's weights and optimizer state after every iteration.
    guarded, unguarded = (step_probe.read(probes[mode]) for mode in ((), ("--no-guard",)))
    assert len(guarded) == nproc and all(len(lines) == 20 for lines in guarded.values())
    counts = {rank: [line.pop("guard") for line in lines][-1] for rank, lines in guarded.items()}
    assert guarded == unguarded
    # Every norm-kernel call of Megatron's took the check's own call's result (one read of the
    # gradients for both); a chain of leaves with their own grad-stats groups (MoE) makes one a leaf.
    assert all(c["checked_steps"] == 20 and c["norm_kernel_calls"] >= 20 for c in counts.values()), counts
    assert all(c["shared_norm_reads"] == c["norm_kernel_calls"] for c in counts.values()), counts
