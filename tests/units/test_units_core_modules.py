"""Core modules no other unit test named (issue 60 item 4), each exercised directly: the
callbacks' one-per-monitor attachment, the configuration's bounds and its file reader, a
detector's rotation, the step clock of the run's state, the publisher's history file, the
token-range and activation detectors, and the protocols Megatron's seams and the monitor keep."""

import json

import pytest

from megatron_patches import callbacks, config_checks, config_load, publish, run_state
from megatron_patches.config import Config
from megatron_patches.detectors.base import Rotation
from megatron_patches.errors import ConfigError
from megatron_patches.incidents import HISTORY_FILE
from megatron_patches.monitor import GradMonitor


@pytest.fixture
def monitor():
    from megatron_patches.seams import build_monitor

    made = build_monitor(Config())
    yield made
    made.close()


class Session(callbacks.Callback):
    def __init__(self, monitor):
        self.monitor = monitor


def test_attached_makes_one_callback_per_monitor_and_a_new_monitor_gets_its_own(monitor):
    from megatron_patches.seams import build_monitor

    assert isinstance(monitor, GradMonitor)
    first = callbacks.attached(monitor, Session)
    assert callbacks.attached(monitor, Session) is first and first.monitor is monitor
    assert [c for c in monitor.state.callbacks if isinstance(c, Session)] == [first]
    other = build_monitor(Config())
    try:
        assert callbacks.attached(other, Session) is not first
    finally:
        other.close()


def test_the_configurations_bounds_say_what_is_wrong_at_their_edges():
    assert config_checks.positive(0) == "must be > 0" and config_checks.positive(1e-9) is None
    assert config_checks.positive(None) is None  # an unset optional field is left alone
    assert config_checks.fraction(1) is not None and config_checks.fraction(0.5) is None
    assert config_checks.share(1) is None and config_checks.share(0) is not None
    assert config_checks.at_least_one(0) == "must be >= 1" and config_checks.non_negative(-1) == "must be >= 0"
    assert config_checks.above_one(1) == "must be > 1"
    assert "from 3 to 255" in config_checks.exit_status(2) and config_checks.exit_status(88) is None
    assert config_checks.http_url("ftp://x") == "must be an http:// or https:// URL"
    assert config_checks.patterns([]) is not None and config_checks.patterns(["decoder.*"]) is None
    assert "nope" in config_checks.known_features(["nope"])


def test_the_config_file_reader_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config_load.read_config_file(str(tmp_path / "absent.yaml"))
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping at the top level, got list"):
        config_load.read_config_file(str(listed))
    good = tmp_path / "good.yaml"
    good.write_text("check_interval: 3\n")
    assert config_load.build(Config, config_load.read_config_file(str(good))).check_interval == 3
    with pytest.raises(ConfigError, match="check_intervall"):
        config_load.build(Config, {"check_intervall": 3})
    assert config_load.redact_url("https://user:token@hooks.example/path?key=secret") == "https://hooks.example/…"


def test_a_rotation_judges_every_intervalth_check_and_covers_each_tensor_once_a_period():
    rotation = Rotation(interval=2, fraction=0.5)
    assert rotation.period == 2
    assert [c for c in range(1, 9) if rotation.due(c)] == [1, 3, 5, 7]
    assert [rotation.turn(c) for c in (1, 3, 5, 7)] == [0, 1, 0, 1]
    for index in range(4):  # each tensor on exactly one judged check of each period
        assert sum(rotation.covers(index, c) for c in (1, 3)) == 1


def test_the_step_clock_counts_unless_the_loop_names_the_step():
    clock = run_state.StepClock()
    assert clock.upcoming() == 1 and clock.tick() == 1 and clock.tick() == 2
    clock.name(10)  # the loop's own iteration number wins
    assert clock.upcoming() == 10 and clock.tick() == 10
    assert clock.upcoming() == 11


def test_the_history_file_holds_world_norms_and_rotates_past_its_limit(tmp_path):
    from megatron_patches.seams import MegatronSeams

    config = config_load.build(Config, {"grad_history_max_lines": 2})
    publisher = publish.Publisher(config, str(tmp_path), MegatronSeams())
    try:
        for step in (1, 2, 3):
            publisher.write_history(step, 5.0, [9.0, 16.0])
    finally:
        publisher.close()
    rotated = [json.loads(line) for line in (tmp_path / (HISTORY_FILE + ".1")).read_text().splitlines()]
    current = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    assert [r["step"] for r in rotated] == [1, 2] and [r["step"] for r in current] == [3]
    assert current[0]["total_norm"] == 5.0 and sorted(current[0]["layers"].values()) == [3.0, 4.0]


def test_token_ids_outside_the_vocabulary_are_counted_into_the_checks_vector_and_looked_up_as_id_0():
    import torch

    from megatron_patches.detectors.base import CheckContext
    from megatron_patches.detectors.tokens import TokenRange

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = torch.nn.Embedding(10, 4)

        def forward(self, ids):
            return self.embedding.word_embeddings(ids)

    model, step = Model(), [1]
    detector = TokenRange(None, lambda: step[0])
    assert detector.attach([model], None) == 1 and detector.width() == 1
    looked_up = model(torch.tensor([[1, 12, -1, 3]]))  # 12 and -1 are outside [0, 10)
    assert torch.equal(looked_up[0, 1], model.embedding.word_embeddings.weight[0])
    out = torch.zeros(1)
    detector.local(CheckContext(step=1, entries=[], grads=[], norms=None, device=torch.device("cpu")), out)
    assert out.tolist() == [2.0]
    step[0] = 2  # a new step counts afresh: a clean batch leaves the vector at zero
    model(torch.tensor([[0, 9]]))
    out = torch.zeros(1)
    detector.local(CheckContext(step=2, entries=[], grads=[], norms=None, device=torch.device("cpu")), out)
    assert out.tolist() == [0.0]


def protocol_members(protocol: type) -> set[str]:
    """The names a ``typing.Protocol`` declares: its methods, properties and annotated attributes."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def test_megatrons_seams_and_the_monitor_have_every_member_their_protocols_declare(monitor):
    from megatron_patches import protocols
    from megatron_patches.seams import MegatronSeams

    seams = MegatronSeams()
    assert protocol_members(protocols.Seams) and protocol_members(protocols.Guard)
    assert sorted(n for n in protocol_members(protocols.Seams) if not hasattr(seams, n)) == []
    assert sorted(n for n in protocol_members(protocols.Guard) if not hasattr(monitor, n)) == []


def test_the_activation_detector_names_the_module_whose_output_jumps_after_its_warmup_and_only_that_one():
    import torch

    from megatron_patches.config_detectors import ActivationsConfig
    from megatron_patches.detectors.activations import ActivationRange
    from megatron_patches.detectors.base import CheckContext

    model = torch.nn.Sequential()
    model.add_module("mlp", torch.nn.Linear(3, 3))
    model.add_module("norm", torch.nn.LayerNorm(3))
    cfg = ActivationsConfig(modules=("mlp",), warmup_steps=3)
    step, checked = [0], set(range(1, 6))
    detector = ActivationRange(cfg, lambda: step[0], lambda s: s in checked)
    assert detector.attach([model], None) == 1  # "norm" is named by no pattern

    def check(scale: float) -> tuple[float, list]:
        step[0] += 1
        torch.manual_seed(step[0])
        model(torch.randn(4, 3) * scale)
        ctx = CheckContext(step=step[0], entries=[], grads=[], norms=None, device=torch.device("cpu"))
        out = torch.zeros(1)
        detector.local(ctx, out)
        found = detector.verdict(ctx, [out.item()])
        held = detector.held(ctx, {"dp": 0})
        detector.commit(ctx, accepted=not found)
        return out.item(), [(f.name, f.reasons) for f in held]

    assert [check(1.0) for _ in range(4)] == [(0.0, [])] * 4  # the warmup and one step past it: quiet
    flags, held = check(1000.0)
    assert flags == 1.0 and held == [("mlp", ["activation:rms"])]
    step[0] = 9  # a step the guard does not check: the hook reads nothing
    model(torch.randn(4, 3) * 1000.0)
    out = torch.zeros(1)
    detector.local(CheckContext(step=9, entries=[], grads=[], norms=None, device=torch.device("cpu")), out)
    assert out.item() == 0.0
