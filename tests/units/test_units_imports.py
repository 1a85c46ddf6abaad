"""The package's import graph has no cycle, counting imports inside functions (issue 22): a seam
that needs the dispatcher, or the registry that needs the code it wires, is a design smell the
function-level import only hides."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patches.seams.targets import TARGETS, TRAINING_TARGETS

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_patches"


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        dotted = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[dotted.removesuffix(".__init__")] = path

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                source = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            graph[name] |= {owner(t) for t in targets if t.startswith("megatron_patches")} - {name, ""}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


# The layers: the core pipeline, Megatron's seams (megatron_patches/seams) over it, and what starts
# a run or a tool over both. The core reaches Megatron only through the Seams it is handed.
OUTER = {"megatron_patches.apply", "megatron_patches.runtime", "megatron_patches.hooks", "megatron_patches.cli",
         "megatron_patches.__main__", "megatron_patches.tiny_gpt", "megatron_patches.launch"}


def layer(module: str) -> str:
    if module in OUTER or module.startswith("megatron_patches.testing"):
        return "outer"
    return "seams" if module.startswith("megatron_patches.seams") else "core"


def test_the_core_never_imports_megatron_seams_or_what_starts_a_run():
    graph = import_graph()
    upward = {(m, t) for m, targets in graph.items() if layer(m) == "core"
              for t in targets if layer(t) != "core"}
    upward |= {(m, t) for m, targets in graph.items() if layer(m) == "seams"
               for t in targets if layer(t) == "outer"}
    assert upward == set()
    assert {layer(m) for m in graph} == {"core", "seams", "outer"}  # the split is not empty on either side



# --- Megatron's seams by integration (issue 60 item 3): one subpackage per integration beside the
# shared patching and watches at seams/ root. The subpackages import the core and the shared part;
# the shared part imports no integration, nor one integration another, but for the crossings listed
# with their reasons ---

INTEGRATIONS = ("megatron_lm", "megatron_bridge", "mindspeed")
CROSSINGS = {
    ("megatron_bridge", "megatron_lm"): "Bridge's loop runs Megatron-LM's checkpoint marks, ledger and in-process "
                                        "rollback on its own config and counters (BridgeMarks, BridgeCounters)",
    ("megatron_lm", "mindspeed"): "MindSpeed-LLM's loop is Megatron-LM's loop patched: its skips (mindspeed.llm) and "
                                  "MindSpeed's refusals run inside Megatron-LM's wrappers",
    ("shared", "mindspeed"): "the patcher works with MindSpeed's patch manager (order, re-wrap, bound copies) and "
                             "every prepare_grads undoes MindSpeed's conversion on a skipped step",
}
"""(importer, imported) between the seams' parts. MindSpeed's part imports no other: the parts form
the layers mindspeed < shared < megatron_lm < megatron_bridge, and nothing imports Bridge's."""


def seams_part(module: str) -> str:
    """``shared`` for the seams' root modules, the integration's name for a module of its subpackage."""
    parts = module.split(".")
    assert parts[:2] == ["megatron_patches", "seams"], module
    return parts[2] if len(parts) > 2 and parts[2] in INTEGRATIONS else "shared"


def test_each_integration_is_a_seams_subpackage_and_they_cross_only_where_listed():
    graph = import_graph()
    for name in INTEGRATIONS:
        assert (PACKAGE / "seams" / name / "__init__.py").is_file(), name
    assert not list((PACKAGE / "seams").glob("megatron_lm*.py")) + list((PACKAGE / "seams").glob("mindspeed*.py"))
    assert not list((PACKAGE / "seams").glob("megatron_bridge*.py"))
    seams = {m for m in graph if layer(m) == "seams"}
    crossings = {(seams_part(m), seams_part(t)) for m in seams for t in graph[m] if t in seams}
    crossings = {(a, b) for a, b in crossings if a != b and b != "shared"}  # an integration may use the shared part
    assert crossings == set(CROSSINGS)  # a new crossing needs its reason here; a gone one leaves the list
    assert cycles({part: {b for a, b in crossings if a == part} for part in ("shared", *INTEGRATIONS)}) == []


def test_the_seams_part_of_a_module():
    assert seams_part("megatron_patches.seams") == "shared"
    assert seams_part("megatron_patches.seams.wrappers") == "shared"
    assert seams_part("megatron_patches.seams.megatron_lm") == "megatron_lm"
    assert seams_part("megatron_patches.seams.megatron_lm.inprocess") == "megatron_lm"
    assert seams_part("megatron_patches.seams.mindspeed.llm") == "mindspeed"

# --- the core imports no megatron or mindspeed module, not even inside a function (issue 43 items 5, 9) ---

FOREIGN = ("megatron", "mindspeed")
"""Top-level packages the core must not import: Megatron's and MindSpeed's (``megatron_patches`` is ours)."""
OUTSIDE_THE_CORE = ("seams", "testing")
"""Subpackages that may import them: Megatron's seams and the CPU test runtime."""


def foreign_imports(root: Path = PACKAGE) -> list[str]:
    """``module.py:line imports name`` for each import of a :data:`FOREIGN` package in the core
    modules under ``root``, wherever the import stands (a function body or a ``TYPE_CHECKING``
    block included), and for each ``importlib.import_module`` / ``__import__`` of one by a literal name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in OUTSIDE_THE_CORE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]
            else:
                continue
            found += [f"{path.relative_to(root.parent)}:{node.lineno} imports {name}" for name in names
                      if name.partition(".")[0] in FOREIGN]
    return found


def test_the_core_imports_no_megatron_or_mindspeed_module():
    """What the core needs of Megatron (the parallel layout, megatron-core's version) it is handed
    by the seams (``Seams.parallel_state``, ``Seams.megatron_core_version``)."""
    assert foreign_imports() == []


def test_the_foreign_import_finder_sees_imports_inside_functions(tmp_path):
    package = tmp_path / "pkg"
    (package / "seams").mkdir(parents=True)
    (package / "seams" / "ok.py").write_text("import megatron.core\n")
    (package / "core.py").write_text("import os\n\n\ndef f():\n    from megatron.core import parallel_state\n"
                                     "    import mindspeed.patch_utils\n    importlib.import_module('megatron.training')\n")
    assert foreign_imports(package) == ["pkg/core.py:5 imports megatron.core",
                                        "pkg/core.py:6 imports mindspeed.patch_utils",
                                        "pkg/core.py:7 imports megatron.training"]


def test_the_core_units_run_with_no_megatron_importable():
    """The unit tests in a process where no ``megatron`` or ``mindspeed`` module imports (the
    ``tests/no_megatron.py`` plugin): every one passes or skips for want of Megatron; this test
    itself is left out of that run."""
    tests = Path(__file__).resolve().parents[1]
    units = sorted(str(p) for p in (tests / "units").glob("test_units_*.py"))
    here = f"{Path(__file__).name}::test_the_core_units_run_with_no_megatron_importable"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no_megatron", "-p", "no:cacheprovider",
                          "--deselect", f"tests/units/{here}", *units], cwd=tests.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-500:]


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_registry_names_its_wrappers_and_each_resolves_to_a_function():
    for target in TARGETS + TRAINING_TARGETS:
        assert isinstance(target.wrapper, str) and target.wrapper.startswith("megatron_patches.")
        assert callable(target.resolve()), target.wrapper


# --- per-run state lives on the run's monitor, not in module globals (issue 22 item 1) ------------

PROCESS_STATE = {
    ("megatron_patches.seams.wrappers", "_monitor"): "the one pointer to the run: its monitor holds the rest",
    ("megatron_patches.seams.patching", "_installed"): "the process's patches of Megatron's classes",
    ("megatron_patches.seams.patching", "_first_call_seen"): "whether a patched target ran yet in the process",
    ("megatron_patches.seams.patching", "_unwatch"): "the process's import watchers for late-imported targets",
    ("megatron_patches.seams.start_line", "_held"): "the process's patches' start line, until it is said",
    ("megatron_patches.seams.start_line", "_deferred"): "whether Megatron-LM's setup is building the model (the line waits)",
    ("megatron_patches.testing.cpu", "_state"): "the CPU runtime's redirects of torch and Megatron",
    ("megatron_patches.testing.megatron_lm_cpu", "_state"): "the CPU runtime's redirects of Megatron-LM's loop",
    ("megatron_patches.testing.fused_adam", "_switched"): "megatron-core's Adam globals the CPU runtime switched to the stand-in",
}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary",
                  "WeakSet", "Injector"}


def module_state() -> set[tuple[str, str]]:
    """(module, name) of each name a ``global`` statement rebinds, and of each module-level
    lowercase name bound to a mutable container."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found |= {(module, name) for name in node.names}
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                value = node.value
                called = value.func if isinstance(value, ast.Call) else None
                name_called = getattr(called, "attr", None) or getattr(called, "id", None)
                if isinstance(value, (ast.Dict, ast.List, ast.Set)) or name_called in _MUTABLE_CALLS:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    found |= {(module, t.id) for t in targets
                              if isinstance(t, ast.Name) and not t.id.isupper() and t.id != "__all__"}
    return found


def test_no_module_keeps_per_run_state():
    """Everything a run keeps (drills, model chunks, Megatron's rerun verdicts, the slow path's
    group, the loop integration's session) hangs off its monitor, so a second run in the process
    starts clean; what stays in modules is the process's, each with its reason above."""
    assert module_state() - PROCESS_STATE.keys() == set()
    assert PROCESS_STATE.keys() <= module_state()  # the list stays true as the code changes


# --- rank 0's decision is pure: no torch, no collectives (issue 60 item 2) ------------------------

_LOADED = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
           "print(sorted(m for m in ('torch', 'megatron_patches.collectives') if m in sys.modules))")


def loaded_with(module: str) -> str:
    """Which of torch and the collectives a fresh process holds after importing ``module``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _LOADED, module], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_decide_imports_neither_torch_nor_the_collectives():
    """``decide.py`` (decide, StepFacts, the assembly of the incident) runs on what it is handed:
    importing it, and all it imports, loads neither torch nor the collectives. The rank side
    (findings.py, which reads the tensors) loads both: the check sees them where they are."""
    assert loaded_with("megatron_patches.decide") == "[]"
    assert loaded_with("megatron_patches.findings") == "['megatron_patches.collectives', 'torch']"
