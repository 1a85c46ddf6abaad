"""The state audit (``detectors.audit``): a weight the optimizer steps, or one of its Adam moments,
changed between two updates is found at the next check whatever the size of the change, named
on the rank that holds it, and rolled back; with the audit off the same faults pass."""

from types import SimpleNamespace

import pytest
import torch

from conftest import run_tiny
from megatron_patches.detectors import audit
from megatron_patches.seams.optimizer_params import audit_refusal

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
DRILLS = {  # step -> (spec, what the record must name as altered)
    25: (f"bitflip:step=25,phase=param,param={FC1},rank=0,scope=element,bit=mantissa_low", "altered:weight"),
    31: (f"sign:step=31,phase=state,slot=exp_avg,param={FC1},rank=0,scope=all", "altered:exp_avg"),
    37: (f"noise:step=37,phase=state,slot=exp_avg_sq,param={FC1},rank=0,scope=row,factor=0.01",
         "altered:exp_avg_sq"),
}


def dp2_run(where, audited: bool):
    """DP2, bf16, distributed optimizer (rank 0's shard holds FC1); a checkpoint two steps before
    each drill is the rollback target. The three drills are hardware-class faults on one device, which
    would fence it at the second (``response.hardware_repeat`` 2, tests/trainings/test_cause.py): this test is
    about the audit finding each, so it allows ten."""
    config = where / "guard.yaml"
    config.write_text(f"detectors: {{audit: {{enabled: {str(audited).lower()}}}}}\n"
                      "recovery: {max_rollbacks: 10, lr_factor: 1.0}\n"
                      "response: {hardware_repeat: 10}\n")  # three faults on rank 0's device: not fenced here
    drills = [arg for spec, _ in DRILLS.values() for arg in ("--inject", spec)]
    return run_tiny(where / "out", "--steps", "42", "--precision", "bf16", "--distributed-optimizer",
                    "--save-interval", "6", "--save-from", "23", "--config", str(config), *drills, nproc=2)


@pytest.mark.multiproc
def test_held_state_altered_between_updates_is_named_where_held_and_rolled_back(tmp_path):
    tmp_path.joinpath("on").mkdir(), tmp_path.joinpath("off").mkdir()
    on, off = dp2_run(tmp_path / "on", True), dp2_run(tmp_path / "off", False)
    assert on.returncode == 0 and off.returncode == 0, on.output[-3000:] + off.output[-3000:]
    found = {r["step"]: r for r in on.incidents}
    for step, (_, altered) in DRILLS.items():
        first, second = found.pop(step), found.pop(step + 1)  # skipped, then rolled back: the fault stays
        assert (first["kind"], first["action"], second["action"]) == ("state_altered", "skip_step", "rollback")
        assert first["origin_ranks"] == [0] and first["first"]["name"] == FC1
        assert first["first"]["ranks"]["global"] == 0 and altered in first["first"]["reasons"]
        assert [f["name"] for f in first["held_altered"]] == [FC1]
    assert found == {}, f"incidents on clean steps: {sorted(found)}"
    assert on.result["params_finite"] and on.result["rollbacks"] == 3
    # Reading the state changes nothing: up to the first drill both runs trained alike, bit for bit.
    assert on.result["losses"][:24] == off.result["losses"][:24]
    # Negative control: without the audit a low mantissa bit of one weight passes unseen.
    assert 25 not in {r["step"] for r in off.incidents}


def test_the_fingerprint_is_the_mixed_sum_of_the_words_modulo_2_to_the_32():
    """Against the definition worked out in numpy on unsigned 64-bit integers: two chunks of words
    (the workspace reused across them and across tensors), 8- and 2-byte elements."""
    import numpy as np

    def reference(tensor):
        flat = tensor.reshape(-1)
        raw = flat.view(torch.int32) if flat.element_size() in (4, 8) else flat.view(torch.int16).to(torch.int32)
        x = raw.numpy().astype(np.int64) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x45D9F3B) & 0xFFFFFFFF
        x ^= x >> 16
        return int(x.sum() & 0xFFFFFFFF)

    torch.manual_seed(0)
    tensors = [torch.randn((1 << 20) + 5), torch.randn(300).double(), torch.randn(4097).bfloat16()]
    assert audit._fingerprints(tensors).tolist() == [reference(t) for t in tensors]


def test_changes_that_cancel_in_plain_sums_change_the_fingerprint():
    from megatron_patches.detectors.fingerprint import _bits_sum

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    signs = x.clone()
    signs[:2] = -signs[:2]  # each flip moves its 32-bit word by 2**31: two cancel in a word sum
    lows = x.clone()
    words = lows.view(torch.int32)
    odd = (words & 1).bool()
    flipped = torch.cat([odd.nonzero()[:32, 0], (~odd).nonzero()[:32, 0]])
    words[flipped] ^= 1  # the lowest bit of 64 words, 32 cleared and 32 set: the word sum is the same
    print_ = audit._fingerprints([x])
    assert _bits_sum(signs) == _bits_sum(x) and audit._fingerprints([signs]) != print_
    assert _bits_sum(lows) == _bits_sum(x) and audit._fingerprints([lows]) != print_
    assert audit._fingerprints([x.clone()]) == print_


@pytest.mark.parametrize("leaf, refused", [
    (SimpleNamespace(config=SimpleNamespace()), None),
    (SimpleNamespace(config=SimpleNamespace(optimizer_cpu_offload=True)), "--optimizer-cpu-offload"),
    (SimpleNamespace(config=SimpleNamespace(use_precision_aware_optimizer=True)), "precision-aware"),
    (SimpleNamespace(config=SimpleNamespace(reuse_fp32_param=True)), "--reuse-fp32-param"),
    (SimpleNamespace(config=SimpleNamespace(), ddp_config=SimpleNamespace(use_megatron_fsdp=True)), "Megatron-FSDP"),
])
def test_the_audit_is_refused_where_it_has_not_run(leaf, refused):
    why = audit_refusal(SimpleNamespace(chained_optimizers=[SimpleNamespace(config=SimpleNamespace()), leaf]))
    assert why is None if refused is None else refused in why
