"""The configuration's refusals without training: unknown keys, wrong types, each bound, webhook
URLs kept out of messages, and config files that are not YAML mappings (config.py, config_load.py)."""

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_patches.config import ENV_VAR, Config, config_path, load_config, read_config_file, redact_url, redacted
from megatron_patches.errors import ConfigError

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


def refused(data) -> str:
    with pytest.raises(ConfigError) as caught:
        Config.from_dict(data)
    return str(caught.value)


def test_nothing_or_an_empty_mapping_is_the_default_config():
    assert Config.from_dict(None) == Config.from_dict({}) == Config()


def test_nested_sections_are_built_and_values_converted():
    config = Config.from_dict({"check_interval": 2, "detectors": {"history": {"zscore": 8, "per_param": False}},
                               "inject": ["nan:step=3"], "alerts": {"webhooks": [{"url": "https://h.example/x"}]}})
    assert config.check_interval == 2 and config.inject == ("nan:step=3",)
    assert config.detectors.history.zscore == 8.0 and isinstance(config.detectors.history.zscore, float)
    assert config.detectors.history.per_param is False
    assert config.detectors.history.warmup_steps == 20  # untouched fields keep their defaults
    (hook,) = config.alerts.webhooks
    assert (hook.url, hook.format, hook.retries) == ("https://h.example/x", "generic", 2)


def test_unknown_keys_are_named_with_the_valid_ones():
    said = refused({"chek_interval": 2})
    assert said.startswith("unknown config key chek_interval at the top level; valid keys: ")
    assert "check_interval" in said and "detectors" in said
    said = refused({"detectors": {"history": {"zscor": 3}}})
    assert said.startswith("unknown config key detectors.history.zscor at detectors.history; valid keys: ")
    assert "zscore" in said and "warmup_steps" in said


def test_a_key_that_is_not_a_name_is_refused():
    assert refused({1: 2}).startswith("config key 1 at the top level is not a name (YAML read it as int)")
    assert "at detectors" in refused({"detectors": {None: 1}})


@pytest.mark.parametrize("data, message", [
    ({"detectors": 3}, "`detectors` must be a mapping, got 3"),
    ({"check_interval": "2"}, "`check_interval` must be an integer, got '2'"),
    ({"check_interval": True}, "`check_interval` must be an integer, got True"),
    ({"check_interval": 1.5}, "`check_interval` must be an integer, got 1.5"),
    ({"enabled": "yes"}, "`enabled` must be true or false, got 'yes'"),
    ({"overflow_mode": "fast"}, "`overflow_mode` must be one of 'auto', 'ieee', 'saturation', got 'fast'"),
    ({"report_dir": 5}, "`report_dir` must be a string, got 5"),
    ({"inject": ["ok", 3]}, "`inject[1]` must be a string, got 3"),
    ({"detectors": {"magnitude": {"total_norm_max": "big"}}},
     "`detectors.magnitude.total_norm_max` must be a number, got 'big'"),
    ({"detectors": {"history": {"zscore": True}}}, "`detectors.history.zscore` must be a number, got True"),
])
def test_wrong_types_name_the_key_path_what_it_takes_and_the_value(data, message):
    assert refused(data) == message


def test_a_single_string_is_not_a_list():
    assert refused({"inject": "nan:step=1"}).startswith("`inject` must be a list of ")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "inf", 10 ** 400])
def test_numbers_must_be_finite(value):
    said = refused({"detectors": {"history": {"zscore": value}}})
    assert said.startswith("`detectors.history.zscore` must be a finite number, got ")


def test_a_number_pyyaml_reads_as_a_string_is_taken_as_meant():
    config = Config.from_dict({"detectors": {"magnitude": {"total_norm_max": "1.0e6", "param_norm_max": 5}}})
    assert config.detectors.magnitude.total_norm_max == 1.0e6
    assert config.detectors.magnitude.param_norm_max == 5.0
    assert Config.from_dict({"detectors": {"magnitude": {"total_norm_max": None}}}).detectors.magnitude.total_norm_max is None


@pytest.mark.parametrize("section, key, value, problem", [
    ("magnitude", "total_norm_max", 0, "must be > 0"),
    ("magnitude", "param_norm_max", -1.0, "must be > 0"),
    ("loss_scale", "max_consecutive_skips", 0, "must be >= 1"),
    ("history", "ema_beta", 1, "must be between 0 and 1 (exclusive)"),
    ("history", "ema_beta", 0, "must be between 0 and 1 (exclusive)"),
    ("history", "drift_ratio", 1, "must be > 1"),
    ("history", "sample_fraction", 0, "must be > 0 and <= 1"),
    ("consistency", "sample_fraction", 1.5, "must be > 0 and <= 1"),
    ("peers", "max_slots", 0, "must be >= 1"),
])
def test_each_detector_bound_names_key_bound_and_value(section, key, value, problem):
    assert refused({"detectors": {section: {key: value}}}) == f"`detectors.{section}.{key}` {problem}, got {value!r}"


@pytest.mark.parametrize("data, message", [
    ({"check_interval": 0}, "`check_interval` must be >= 1, got 0"),
    ({"recovery": {"lr_factor": 1.5}}, "`recovery.lr_factor` must be > 0 and <= 1, got 1.5"),
    ({"recovery": {"lr_floor": 0}}, "`recovery.lr_floor` must be > 0 and <= 1, got 0"),
    ({"recovery": {"snapshot_interval": 0}}, "`recovery.snapshot_interval` must be >= 1, got 0"),
    ({"recovery": {"mode": "inprocess"}}, "`recovery.mode` must be one of 'in_process', 'restart', got 'inprocess'"),
    ({"response": {"peer_timeout_s": 0}}, "`response.peer_timeout_s` must be > 0, got 0"),
    ({"alerts": {"command_retries": -1}}, "`alerts.command_retries` must be >= 0, got -1"),
    ({"alerts": {"queue_size": 0}}, "`alerts.queue_size` must be >= 1, got 0"),
])
def test_bounds_outside_the_detectors(data, message):
    assert refused(data) == message


def test_values_on_the_bound_itself_are_accepted():
    config = Config.from_dict({"detectors": {"history": {"sample_fraction": 1, "min_ratio": 1},
                                             "consistency": {"sample_fraction": 1.0}},
                               "alerts": {"command_retries": 0}, "recovery": {"lr_factor": 1, "lr_floor": 1}})
    assert config.detectors.history.sample_fraction == 1.0 and config.alerts.command_retries == 0
    assert config.recovery.lr_factor == 1 and config.recovery.lr_floor == 1  # a rollback without a cut


SECRET = "T0KEN-abc123"


def test_a_webhook_url_that_is_not_http_is_refused_showing_only_its_host():
    said = refused({"alerts": {"webhooks": [{"url": f"ftp://hooks.example/services/{SECRET}"}]}})
    assert said == "`alerts.webhooks[0].url` must be an http:// or https:// URL, got 'ftp://hooks.example/…'"
    said = refused({"alerts": {"webhooks": [{"url": f"hooks.example/{SECRET}?key={SECRET}"}]}})
    assert SECRET not in said and "'hooks.example/…'" in said


def test_a_webhook_url_of_the_wrong_type_is_not_shown():
    said = refused({"alerts": {"webhooks": [{"url": [SECRET]}]}})
    assert SECRET not in said
    assert said == "`alerts.webhooks[0].url` must be a string (the value is not shown: it may hold a token)"


def test_a_webhook_without_a_url_says_what_to_add():
    assert "needs a `url`" in refused({"alerts": {"webhooks": [{"format": "slack"}]}})
    assert "must be one of 'generic', 'slack', 'feishu', 'dingtalk'" in refused(
        {"alerts": {"webhooks": [{"url": "https://h.example/x", "format": "teams"}]}})


@pytest.mark.parametrize("url, shown", [
    (f"https://user:{SECRET}@hooks.example:8443/a/{SECRET}?t={SECRET}", "https://hooks.example/…"),
    (f"hooks.example/{SECRET}", "hooks.example/…"),
    (f"{SECRET}@hooks.example", "hooks.example/…"),
    ("", "…/…"),
])
def test_redact_url_keeps_scheme_and_host_only(url, shown):
    assert redact_url(url) == shown


def test_redacted_cuts_every_webhook_url_and_leaves_the_original_alone():
    data = dataclasses.asdict(Config.from_dict({"alerts": {"webhooks": [{"url": f"https://a.example/{SECRET}"},
                                                                         {"url": f"http://b.example/?k={SECRET}"}]}}))
    out = redacted(data)
    assert [h["url"] for h in out["alerts"]["webhooks"]] == ["https://a.example/…", "http://b.example/…"]
    assert SECRET in data["alerts"]["webhooks"][0]["url"]
    assert redacted({"check_interval": 1}) == {"check_interval": 1}


def test_config_is_frozen_keyword_only_and_replace_validates():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.check_interval = 2
    with pytest.raises(TypeError):
        Config(True)
    assert config.replace(check_interval=4).check_interval == 4 and config.check_interval == 1
    with pytest.raises(ConfigError, match="`check_interval` must be >= 1, got 0"):
        config.replace(check_interval=0)


# --- files ------------------------------------------------------------------------------


def file_refused(path) -> str:
    with pytest.raises(ConfigError) as caught:
        read_config_file(str(path))
    return str(caught.value)


def test_a_config_file_is_read_into_a_mapping(tmp_path):
    path = tmp_path / "guard.yaml"
    path.write_text("check_interval: 3\ndetectors:\n  magnitude:\n    total_norm_max: 1.0e6\n")
    assert read_config_file(str(path)) == {"check_interval": 3, "detectors": {"magnitude": {"total_norm_max": "1.0e6"}}}
    assert load_config(str(path)).detectors.magnitude.total_norm_max == 1.0e6
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    assert read_config_file(str(empty)) == {} and load_config(str(empty)) == Config()


def test_config_files_that_are_not_yaml_mappings_are_refused_in_one_line(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert file_refused(missing) == f"config file {str(missing)!r} does not exist (set {ENV_VAR} to a YAML file)"
    assert "is a directory; pass the YAML file inside it" in file_refused(tmp_path)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"report_dir: caf\xe9\n")
    assert "is not UTF-8 text (byte 15); save it as UTF-8 YAML" in file_refused(latin)
    broken = tmp_path / "broken.yaml"
    broken.write_text("detectors: [\n")
    said = file_refused(broken)
    assert "is not valid YAML: " in said and "\n" not in said
    listed = tmp_path / "list.yaml"
    listed.write_text("- check_interval\n")
    assert file_refused(listed).endswith("must hold a mapping at the top level, got list")


def test_the_environment_names_the_file_when_no_path_is_given(tmp_path, monkeypatch):
    path = tmp_path / "env.yaml"
    path.write_text("check_interval: 5\n")
    monkeypatch.setenv(ENV_VAR, str(path))
    assert config_path() == str(path) and load_config().check_interval == 5
    assert config_path("other.yaml") == "other.yaml"  # an explicit path wins
    monkeypatch.setenv(ENV_VAR, "")
    assert config_path() is None and load_config() == Config()
    monkeypatch.delenv(ENV_VAR)
    assert load_config() == Config()


REPO = Path(__file__).resolve().parents[2]


def test_the_configuration_reference_is_the_one_the_code_generates():
    from megatron_patches import config_reference

    written = (REPO / "docs" / "configuration.md").read_text()
    assert written == config_reference.render(), (
        "docs/configuration.md drifted from megatron_patches/config.py: "
        "python -m megatron_patches.config_reference > docs/configuration.md")


def yaml_blocks() -> list[tuple[str, str]]:
    """(file, block) of every ```yaml block in the README and docs/: each is a guard config."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S):
            found.append((path.relative_to(REPO).as_posix(), block))
    return found


def test_every_config_the_docs_show_is_accepted_by_the_code():
    """The keys live once, in docs/configuration.md (generated); a YAML example elsewhere must still be a
    config the code accepts: a renamed or removed key in one fails here."""
    import yaml

    blocks = yaml_blocks()
    assert len(blocks) >= 5
    for where, block in blocks:
        try:
            Config.from_dict(yaml.safe_load(block))
        except ConfigError as exc:
            pytest.fail(f"a YAML example in {where} is refused: {exc}")


def test_the_readme_config_shows_the_defaults_but_disable_features():
    """The README says each value of its short config is the default, but disable_features."""
    import yaml

    [block] = [b for where, b in yaml_blocks() if where == "README.md"]
    shown = yaml.safe_load(block)
    assert shown["recovery"].pop("disable_features") == ["dropout"]
    assert Config.from_dict(shown) == Config()


@pytest.mark.parametrize("codes, problem", [
    ({"critical": 0}, "response.exit_codes.critical"), ({"rollback": 2}, "from 3 to 255"),
    ({"stop": 256}, "from 3 to 255"), ({"critical": 84}, "each outcome needs its own code")])
def test_exit_codes_out_of_range_or_shared_are_refused_in_one_line(codes, problem):
    message = refused({"response": {"exit_codes": codes}})
    assert problem in message and "\n" not in message, message


def test_exit_codes_map_each_decision_to_the_configured_status():
    from megatron_patches.decisions import Action, Decision, Severity, exit_code

    codes = Config.from_dict({"response": {"exit_codes": {"rollback": 90, "stop": 91, "critical": 93}}}).response.exit_codes
    assert exit_code(Decision(Severity.ERROR, Action.ROLLBACK, "", 1), codes) == 90
    assert exit_code(Decision(Severity.ERROR, Action.STOP, "", 1), codes) == 91
    assert exit_code(Decision(Severity.CRITICAL, Action.STOP, "", 1), codes) == 93
    assert exit_code(Decision(Severity.CRITICAL, Action.STOP, "", 1)) == 86  # the defaults
    assert codes.peer_lost == 87
