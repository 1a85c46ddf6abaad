"""scripts/megatron_patch.py against real Megatron sources.

CI has no Megatron-LM checkout, but the megatron-core source distribution holds the real
``megatron/core/optimizer/optimizer.py``: it is downloaded once from the package index into
pytest's cache (shared by both CI legs) and unpacked per test. Tests that need a Megatron-LM checkout (``pretrain_gpt.py``) read
``MEGATRON_LM_DIR`` and never modify it: they patch a copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "megatron_patch.py"
SDIST_VERSION = "0.16.1"
OPTIMIZER = Path("megatron/core/optimizer/optimizer.py")
LM_FILES = [Path("pretrain_gpt.py"), Path("megatron/core/package_info.py"), OPTIMIZER]

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not on PATH: the script patches with git apply")


def patch_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def download_sdist(path: Path, index: str = "https://pypi.org/simple") -> None:
    """The megatron-core sdist from the index's JSON simple API (PEP 691), checked against its
    sha256. ``pip download --no-binary`` would first build the package's metadata in an isolated
    environment (about 60 s here) for a file this test only unpacks."""
    import hashlib
    import json
    import urllib.request

    request = urllib.request.Request(f"{index}/megatron-core/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        [entry] = [f for f in json.load(answer)["files"] if f["filename"] == path.name]
    with urllib.request.urlopen(entry["url"], timeout=120) as answer:
        data = answer.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise OSError(f"{path.name}: sha256 differs from the index's")
    partial = path.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(path)


@pytest.fixture(scope="session")
def sdist_archive(request) -> Path:
    path = request.config.cache.mkdir("megatron-core-sdist") / f"megatron_core-{SDIST_VERSION}.tar.gz"
    if not path.exists():
        try:
            download_sdist(path)
        except (OSError, ValueError, KeyError) as error:  # urllib's errors are OSErrors
            reason = f"could not download the megatron-core {SDIST_VERSION} sdist: {error}"
            print(reason)
            pytest.skip(reason)
    return path


@pytest.fixture
def sdist_tree(sdist_archive, tmp_path) -> Path:
    """A fresh, unpatched megatron-core source tree (holds megatron/core, no pretrain_gpt.py)."""
    with tarfile.open(sdist_archive) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / f"megatron_core-{SDIST_VERSION}"


@needs_git
def test_apply_then_revert_restores_the_optimizer_source(sdist_tree):
    original = (sdist_tree / OPTIMIZER).read_bytes()

    status = patch_cli("status", "--megatron", sdist_tree, "--only", "optimizer")
    assert status.returncode == 1 and "not patched" in status.stdout

    applied = patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer")
    assert applied.returncode == 0, applied.stderr
    source = (sdist_tree / OPTIMIZER).read_text()
    assert source.count("    @_mp_hooks.checked_prepare_grads\n    def prepare_grads(") == 3
    assert source.count("    @_mp_hooks.checked_clip_grad_norm\n    def clip_grad_norm(") == 1
    assert "from megatron_patches import hooks as _mp_hooks" in source
    assert patch_cli("status", "--megatron", sdist_tree, "--only", "optimizer").returncode == 0

    reverted = patch_cli("revert", "--megatron", sdist_tree, "--only", "optimizer")
    assert reverted.returncode == 0, reverted.stderr
    assert (sdist_tree / OPTIMIZER).read_bytes() == original


@needs_git
def test_second_apply_says_already_patched(sdist_tree):
    assert patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer").returncode == 0
    patched = (sdist_tree / OPTIMIZER).read_bytes()

    again = patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer")
    assert again.returncode == 0
    assert "already patched" in again.stdout
    assert (sdist_tree / OPTIMIZER).read_bytes() == patched


@needs_git
def test_incompatible_tree_is_named_and_left_untouched(sdist_tree):
    path = sdist_tree / OPTIMIZER
    # A local edit next to FP32Optimizer.prepare_grads: that one hunk no longer matches.
    edited = path.read_text().replace(
        '        """FP32 optimizer does not do any scaling."""\n        return self._scale\n',
        '        """FP32 optimizer does not do any scaling."""\n        return self._scale  # local edit\n',
    )
    assert edited != path.read_text()
    path.write_text(edited)

    result = patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer")
    assert result.returncode == 2
    assert "incompatible tree: megatron/core/optimizer/optimizer.py: hunk @@" in result.stderr
    assert "class FP32Optimizer" in result.stderr
    assert path.read_text() == edited


@needs_git
def test_package_without_pretrain_gpt_asks_for_only_optimizer(sdist_tree):
    original = (sdist_tree / OPTIMIZER).read_bytes()
    result = patch_cli("apply", "--megatron", sdist_tree)
    assert result.returncode == 2
    assert "--only optimizer" in result.stderr
    assert (sdist_tree / OPTIMIZER).read_bytes() == original


@needs_git
def test_unsupported_version_is_refused_with_the_supported_list(sdist_tree):
    info = sdist_tree / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 11"))
    result = patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer")
    assert result.returncode == 2
    assert "megatron-core 0.11.1 is not a supported version line" in result.stderr
    assert "0.16 (core_v0.16)" in result.stderr
    assert "0.19 (core_v0.19)" in result.stderr


def load_patch_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_patch_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("minor", range(12, 21))
def test_every_supported_minor_has_a_complete_patch_directory(minor):
    script = load_patch_script()
    line = script.VERSION_LINES.get((0, minor))
    assert line is not None, f"0.{minor} has no entry in VERSION_LINES"
    directory = script.PATCHES_DIR / line
    assert directory.is_dir(), f"0.{minor} -> {directory} does not exist"
    for name, _target in script.PARTS.values():
        assert (directory / name).is_file(), f"{directory} lacks {name}"
    assert script.pick_line((0, minor, 0, ""), None) == directory


def test_patch_files_carry_no_upstream_copyright_header():
    for patch in sorted((REPO / "patches").glob("*/*.patch")):
        assert "Copyright" not in patch.read_text(), patch


@needs_git
def test_tree_vendored_inside_another_git_repo_is_patched(sdist_tree, tmp_path):
    # Plain `git apply` run inside another repository's subdirectory skips the files and exits 0.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    result = patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer")
    assert result.returncode == 0, result.stderr
    assert "@_mp_hooks.checked_prepare_grads" in (sdist_tree / OPTIMIZER).read_text()


IMPORT_PATCHED_OPTIMIZER = textwrap.dedent(
    """
    import importlib.util, json, sys
    tree, hide = sys.argv[1], sys.argv[2] == "hide"
    if hide:
        # megatron_patches absent: drop the editable-install finder and any path that holds it.
        sys.meta_path = [f for f in sys.meta_path if "megatron_patches" not in repr(f)]
        sys.path = [p for p in sys.path if p not in ("", ".")
                    and not __import__("os").path.isdir(__import__("os").path.join(p, "megatron_patches"))]
        assert importlib.util.find_spec("megatron_patches") is None
    sys.path.insert(0, tree)
    import megatron.core.optimizer.optimizer as opt
    methods = [opt.ChainedOptimizer.prepare_grads, opt.MixedPrecisionOptimizer.prepare_grads,
               opt.FP32Optimizer.prepare_grads]
    print(json.dumps({
        "file": opt.__file__,
        "hooks_module": getattr(opt._mp_hooks, "__name__", None),
        # torch.no_grad() keeps the method it decorates in __wrapped__.
        "prepare_grads_hooked": [hasattr(m.__wrapped__, "__megatron_patches__") for m in methods],
        "clip_grad_norm_hooked": hasattr(opt.MegatronOptimizer.clip_grad_norm, "__megatron_patches__"),
    }))
    """
)


def import_patched_optimizer(tree: Path, hide: bool) -> dict:
    import json

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_PATCHED_OPTIMIZER, str(tree), "hide" if hide else "keep"],
        capture_output=True, text=True, timeout=300, cwd=tree, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.process
@needs_git
def test_patched_optimizer_imports_unchanged_without_megatron_patches(sdist_tree):
    assert patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer").returncode == 0
    seen = import_patched_optimizer(sdist_tree, hide=True)
    assert seen["file"] == str(sdist_tree / OPTIMIZER)
    assert seen["hooks_module"] == "_mp_hooks"  # the identity fallback class
    assert seen["prepare_grads_hooked"] == [False, False, False]
    assert seen["clip_grad_norm_hooked"] is False


@pytest.mark.process
@needs_git
def test_patched_optimizer_calls_the_hooks_when_megatron_patches_is_installed(sdist_tree):
    pytest.importorskip("megatron_patches.hooks")
    assert patch_cli("apply", "--megatron", sdist_tree, "--only", "optimizer").returncode == 0
    seen = import_patched_optimizer(sdist_tree, hide=False)
    assert seen["file"] == str(sdist_tree / OPTIMIZER)
    assert seen["hooks_module"] == "megatron_patches.hooks"
    assert seen["prepare_grads_hooked"] == [True, True, True]
    assert seen["clip_grad_norm_hooked"] is True


# --- with a Megatron-LM checkout (MEGATRON_LM_DIR); the checkout itself is never modified ---------


@pytest.mark.megatron_lm
@needs_git
def test_checkout_round_trip_on_a_copy(megatron_lm_dir, tmp_path):
    copy = tmp_path / "Megatron-LM"
    for rel in LM_FILES:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(megatron_lm_dir / rel, copy / rel)
    before = {rel: (copy / rel).read_bytes() for rel in LM_FILES}

    status = patch_cli("status", "--megatron", copy)
    assert status.returncode in (0, 1), status.stderr  # 2 would mean an incompatible checkout
    first, second = ("revert", "apply") if status.returncode == 0 else ("apply", "revert")
    assert patch_cli(first, "--megatron", copy).returncode == 0
    middle = patch_cli("status", "--megatron", copy)
    assert middle.returncode == (1 if first == "revert" else 0), middle.stdout
    if first == "apply":
        head = (copy / "pretrain_gpt.py").read_text().split("from megatron")[0]
        assert "import megatron_patches.apply" in head
    assert patch_cli(second, "--megatron", copy).returncode == 0
    assert {rel: (copy / rel).read_bytes() for rel in LM_FILES} == before


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@needs_git
def test_patched_pretrain_gpt_trains_on_two_cpu_ranks(megatron_lm_dir, tmp_path):
    copy = tmp_path / "Megatron-LM"
    shutil.copytree(megatron_lm_dir, copy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    patch_cli("revert", "--megatron", copy)  # start from stock if the checkout was patched
    assert patch_cli("apply", "--megatron", copy).returncode == 0

    tiny = [*TINY_GPT_ARGS, "--train-iters", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "megatron_patches.testing.pretrain_cpu", str(copy / "pretrain_gpt.py"), *tiny],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "[megatron_patches]" in output  # pretrain_gpt.py's import line installed the guard
    losses = [float(part.split(":")[1]) for part in output.split("|") if part.strip().startswith("lm loss:")]
    assert len(losses) == 3 and all(loss == loss and loss < 100 for loss in losses), losses
