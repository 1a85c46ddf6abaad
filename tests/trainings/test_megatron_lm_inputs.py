"""Faults in what the model reads and computes, in Megatron-LM's loop: token ids outside the
vocabulary, an activation x1000 on one rank."""

from __future__ import annotations


import pytest

from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    loop_kind, megatron_lm_checkout, make_loop, guard_env, iterations, incidents)


@pytest.mark.multiproc
def test_token_ids_outside_the_vocabulary_from_one_rank_are_named_there_in_megatrons_loop(loop_kind, request,
                                                                                         tmp_path):
    """Megatron-LM's own batches: rank 1's token ids at iteration 3 get bit 30 flipped in one place
    (``phase=input``). The word embedding's pre-hook (``detectors.tokens``) counts it, hands the
    lookup 0 instead, and the step is skipped with rank 1 named; Megatron's loop trains on."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    drill = "bitflip:step=3,rank=1,phase=input,module=embedding.word_embeddings,bit=30,scope=element"
    proc = loop.run(guard_env(tmp_path, inject=[drill]))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "fired into the token ids fed to embedding.word_embeddings on rank 1: changed 1 of" in output
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["action"]) == (3, "vocab", "skip_step")
    assert incident["origin_ranks"] == [1] and incident["first"]["reasons"] == ["input:vocab"]
    assert incident["first"]["name"] == "embedding.word_embeddings.weight"
    assert incident["vocab"]["ids_outside"] >= 1
    logged = iterations(output)
    assert "number of skipped iterations:   1" in logged[3] and sorted(logged)[-1] == 6


@pytest.mark.multiproc
def test_an_activation_x1000_on_one_rank_is_named_at_its_module_in_megatrons_loop(loop_kind, request, tmp_path):
    """``detectors.activations`` in Megatron-LM's own loop (DP2): rank 1's MLP output of layer 1
    multiplied by 1,000 at iteration 25 stays finite; the module and the rank are named, the step
    skipped, and the loop trains on."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    drill = "scale:step=25,rank=1,phase=forward,module=decoder.layers.1.mlp,factor=1000,scope=all"
    env = guard_env(tmp_path, inject=[drill], detectors={"activations": {"enabled": True}})
    proc = loop.run(env, "--train-iters", "26")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["action"]) == (25, "activation", "skip_step")
    assert incident["origin_ranks"] == [1] and incident["first"]["name"] == "decoder.layers.1.mlp"
    assert "number of skipped iterations:   1" in iterations(output)[25]
