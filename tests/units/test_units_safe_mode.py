"""Safe mode on retry (megatron_patches.safe_mode): the feature table, groups, the switch on
Megatron-LM's argument namespace, and the one-line refusal of a name it does not know."""

import argparse

import pytest

from megatron_patches import safe_mode
from megatron_patches.config import Config
from megatron_patches.errors import ConfigError


def test_a_feature_switches_its_arguments_off_and_says_what_changed():
    args = argparse.Namespace(hidden_dropout=0.1, attention_dropout=0.0, overlap_grad_reduce=True,
                              overlap_param_gather=True, apply_rope_fusion=False)
    changed, already = safe_mode.switch_off(args, ["dropout", "overlap_grad_reduce", "rope_fusion", "moe_router_fusion"])
    assert changed == ["hidden_dropout 0.1 -> 0.0", "overlap_param_gather True -> False",
                       "overlap_grad_reduce True -> False"]
    assert already == ["rope_fusion", "moe_router_fusion"]  # off already; absent from this namespace
    assert (args.hidden_dropout, args.overlap_grad_reduce, args.overlap_param_gather) == (0.0, False, False)


def test_groups_expand_once_in_order():
    assert safe_mode.expand(["overlap", "overlap_grad_reduce", "dropout"]) == [
        "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "dropout"]
    assert "bias_gelu_fusion" in safe_mode.GROUPS["fusions"] and "dropout" not in safe_mode.GROUPS["fusions"]


def test_an_unknown_name_is_refused_in_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as error:
        Config.from_dict({"recovery": {"disable_features": ["dropout", "grouped_gemm"]}})
    message = str(error.value)
    assert "\n" not in message and message.startswith("`recovery.disable_features` names no feature")
    assert "(grouped_gemm)" in message and "known: dropout, " in message and "fusions, overlap" in message
    assert Config.from_dict({"recovery": {"disable_features": ["fusions", "dropout"]}}).recovery.disable_features == (
        "fusions", "dropout")


def test_every_argument_in_the_table_is_one_megatron_lm_parses():
    """Read off Megatron-LM's own parser (0.17+ ships megatron/training), so a renamed flag shows."""
    arguments = pytest.importorskip("megatron.training.arguments")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    dests = {action.dest for action in parser._actions}
    missing = [arg for feature in safe_mode.FEATURES.values() for arg, _ in feature.off if arg not in dests]
    assert missing == []


def test_the_docs_table_lists_every_feature_and_group():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "megatron_lm.md").read_text()
    rows = [line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| `")]
    named = [row.split("`")[1] for row in rows]
    assert [n for n in named if n in safe_mode.KNOWN] == list(safe_mode.KNOWN)
