"""The guard's surface (issue 60 item 1): the :class:`~megatron_patches.protocols.Guard` protocol
stays small, only the core writes the guard's state, and the executor is called only through
what :class:`~megatron_patches.protocols.Executor` lists. Read from the source (no Megatron, no
ranks), so each rule holds for code no test runs."""

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_patches.config import Config
from megatron_patches.monitor import GradMonitor
from megatron_patches.protocols import Executor, Guard
from megatron_patches.recovery import ExitAndRestart, InProcessRecovery
from megatron_patches.run_state import RunState

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_patches"
GUARD_NAMES = {"monitor", "_monitor", "guard"}
"""The names the guard goes by where it is handed on (a parameter, ``self.monitor``, the wrappers' pointer)."""
OUTER = {"apply", "runtime", "hooks", "cli", "__main__", "tiny_gpt", "launch"}
"""What starts a run or a tool, as tests/test_units_imports.py's layers have it; with seams/ and
testing/ it is everything outside the core."""


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a protocol class declares."""
    declared = {name for name in vars(protocol) if not name.startswith("_")}
    return declared | set(getattr(protocol, "__annotations__", {}))


def test_the_guard_protocol_has_at_most_twelve_members_and_the_monitor_has_each():
    members = protocol_members(Guard)
    assert len(members) <= 12, sorted(members)
    missing = {name for name in members if not hasattr(GradMonitor, name)} - {"state"}  # state: set per run
    assert missing == set()
    assert hasattr(GradMonitor(Config(), _NoSeams()), "state")


def test_the_monitor_keeps_no_alias_of_its_run_state():
    """One name per thing: a run's objects are read on ``monitor.state``. Two read-only views stay:
    ``counters`` (a write goes through ``count``) and ``overflow_mode`` (resolved on the device at
    its first read)."""
    fields = {f.name for f in dataclasses.fields(RunState)}
    assert {name for name in fields if hasattr(GradMonitor, name)} == {"counters", "overflow_mode"}
    assert GradMonitor.overflow_mode.fset is None
    monitor = GradMonitor(Config(), _NoSeams())
    with pytest.raises(TypeError):
        monitor.counters["checked_steps"] = 5
    monitor.count("checked_steps", 2)
    assert monitor.counters["checked_steps"] == monitor.state.counters["checked_steps"] == 2


def _guard_rooted(target: ast.expr) -> bool:
    """Whether an assignment target reaches into the guard: ``monitor.x``, ``self.monitor.state.x``,
    ``guard.state.counters[k]``... (binding ``self.monitor`` itself is not)."""
    node, below_guard = target, False
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        inner = node.value
        if isinstance(inner, ast.Name) and inner.id in GUARD_NAMES:
            return True
        if isinstance(inner, ast.Attribute) and inner.attr in GUARD_NAMES:
            below_guard = True
            break
        node = inner
    return below_guard


def guard_writes(source: str, where: str = "<source>") -> list[str]:
    """``where:line`` of each assignment (plain, augmented, annotated, ``setattr``) into the guard."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="_", ctx=ast.Store())]
        else:
            continue
        found += [(node.lineno, f"{where}:{node.lineno}") for target in targets if _guard_rooted(target)]
    return [hit for _, hit in sorted(found)]


def outside_the_core(root: Path = PACKAGE) -> list[Path]:
    return [path for path in sorted(root.rglob("*.py"))
            if path.relative_to(root).parts[0] in ("seams", "testing") or path.stem in OUTER]


def test_nothing_outside_the_core_writes_the_guard():
    """Seams, the CPU runtime and what starts a run read the guard and call its methods; its state
    is changed by the core alone (the served norm is the seams' own: ``served_norm.HeldNorm``)."""
    modules = outside_the_core()
    assert any(path.name == "served_norm.py" for path in modules) and len(modules) > 20
    found = [hit for path in modules for hit in guard_writes(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert found == []


# The served norm as seams/served_norm.py kept it before issue 60: on the monitor, written from the seam.
_BEFORE = '''
def remember(monitor, optimizer, step, total_norm, entries, grads):
    if not grads_in_float32(optimizer):
        monitor.checked_norm = None
        return
    monitor.checked_norm = CheckedNorm(weakref.ref(optimizer), step, total_norm, entries, (), ())


def take(monitor, optimizer):
    checked, monitor.checked_norm = monitor.checked_norm, None
    self.monitor.state.counters["served_norms"] += 1
    setattr(guard, "step", 3)
    self.monitor = monitor
'''


def test_the_write_finder_sees_the_served_norm_as_it_was():
    """Negative control: the scan flags the writes served_norm.py made before the norm moved to the
    seams (and an item write, an augmented one, a setattr), and not the binding of ``self.monitor``."""
    assert guard_writes(_BEFORE) == ["<source>:4", "<source>:6", "<source>:10", "<source>:11", "<source>:12"]


def test_the_executor_is_called_only_through_its_protocol():
    """No ``getattr`` on the executor in the package (what the guard calls on it, the protocol
    lists), and every executor of the core has each member the protocol lists."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                    and node.args and "executor" in ast.unparse(node.args[0])):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []
    members = protocol_members(Executor)
    assert members == {"in_process", "replays", "ledger_path", "settle_exit"}
    for executor in (InProcessRecovery, ExitAndRestart):
        assert {name for name in members if not hasattr(executor, name) and name not in _set_in_init(executor)} == set()


def _set_in_init(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` assigns on ``self``."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


class _NoSeams:
    """A stand-in for Megatron's seams where no Megatron exists (the monitor is only built here,
    never run): each per-run watch the run state asks for is an empty object."""

    def parallel_state(self):
        return None

    def model_chunks(self):
        return object()

    def rerun_watch(self):
        return object()

    def origin_watch(self, enabled, peak_ratio=None):
        return object()

    def loss_scale_watch(self, settings):
        return object()

    def record_fields(self, everyone, extra):
        return {}, ""
