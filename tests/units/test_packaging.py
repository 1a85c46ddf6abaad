"""The wheel users install holds the product, not the repository's test vehicle (issue 43 item 5):
no ``megatron_patches/testing``, every other module. Installed from that wheel alone, the opt-in
imports and the tiny-GPT command says in one line that it needs a checkout of the repository.
The editable install (``make install``) keeps ``megatron_patches.testing`` importable."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.one_line]  # a fresh process; the same on every line

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = "megatron_patches/testing/"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A clean copy of what setup.py packages (a build/ folder left in the checkout could carry
    files of an earlier build into the wheel)."""
    copy = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "megatron_patches", copy / "megatron_patches", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip("wheel", "--wheel-dir", str(out), str(source))
    (found,) = out.glob("megatron_patches-*.whl")
    return found


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -S args`` seeing the unpacked wheel and this interpreter's site-packages (torch,
    megatron-core) as plain paths: no .pth file runs, so an editable install of the checkout
    cannot lend the package back its testing/."""
    libraries = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *libraries])}
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_wheel_leaves_the_test_runtime_out_and_holds_every_other_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [n for n in names if n.startswith(LEFT_OUT)] == []
    product = {path.relative_to(ROOT).as_posix() for path in (ROOT / "megatron_patches").rglob("*.py")
               if not path.relative_to(ROOT).as_posix().startswith(LEFT_OUT)}
    assert product - names == set()
    assert {"megatron_patches/apply.py", "megatron_patches/seams/parallel.py"} <= names


def test_installed_from_the_wheel_the_opt_in_imports_and_the_demo_asks_for_a_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    opt_in = run_installed(site, tmp_path, "-c", "import importlib.util, megatron_patches.apply as a; "
                           "print(a.__file__); print(importlib.util.find_spec('megatron_patches.testing'))")
    assert opt_in.returncode == 0, opt_in.stderr
    assert opt_in.stdout.splitlines() == [str(site / "megatron_patches" / "apply.py"), "None"]

    demo = run_installed(site, tmp_path, "-m", "megatron_patches.tiny_gpt", "--steps", "1")
    assert demo.returncode != 0 and demo.stdout == ""
    assert demo.stderr.splitlines() == [demo.stderr.strip()] and "Traceback" not in demo.stderr
    assert "the tiny-GPT demo needs a checkout of the repository" in demo.stderr


def test_an_editable_install_keeps_the_test_runtime(source, tmp_path):
    """``make install`` (``pip install -e .``): the repository's tests and ``make demo`` import
    megatron_patches.testing from the checkout."""
    # --ignore-installed: pip would otherwise first uninstall this environment's own install of the package.
    pip("install", "--ignore-installed", "--editable", str(source), "--prefix", str(tmp_path / "prefix"))
    site = sysconfig.get_path("purelib", vars={"base": str(tmp_path / "prefix"), "platbase": str(tmp_path / "prefix")})
    found = run_installed(Path(site), tmp_path, "-c", f"import site; site.addsitedir({site!r}); "
                          "import megatron_patches.testing.tiny_gpt as t; print(t.__file__)")
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(source / "megatron_patches" / "testing" / "tiny_gpt.py")


def test_installed_with_no_deps_into_an_environment_with_torch_and_megatron_core(wheel, tmp_path):
    """README, "Install into your training environment": ``pip install --no-deps`` into an environment
    that has torch and megatron-core installs no second megatron-core; the opt-in imports from the
    installed wheel and ``megatron-patches launch`` runs. The fresh venv sees this environment's
    torch and megatron-core through a .pth line (a path only: the editable install's finder there
    does not run, so nothing but the wheel can provide megatron_patches)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    libraries = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    (Path(purelib) / "training_environment.pth").write_text("\n".join(libraries) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_PATCHES_CONFIG")}

    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", str(wheel)], capture_output=True, text=True, env=env, timeout=120)
    assert install.returncode == 0, install.stderr
    installed = sorted(p.name for p in Path(purelib).iterdir())
    assert [n for n in installed if n.startswith("megatron_patches-")] == ["megatron_patches-0.1.0.dist-info"]
    assert [n for n in installed if n.startswith(("megatron_core", "megatron"))] == ["megatron_patches",
                                                                                   "megatron_patches-0.1.0.dist-info"]

    where = subprocess.run([str(python), "-c", "import megatron_patches.apply as a, megatron.core as m; "
                            "print(a.__file__); print(m.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    apply_file, core_file = where.stdout.splitlines()[-2:]
    assert apply_file == str(Path(purelib) / "megatron_patches" / "apply.py")
    assert any(core_file.startswith(lib + os.sep) for lib in libraries), core_file

    launch = venv / "bin" / "megatron-patches"
    helped = subprocess.run([str(launch), "launch", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: megatron-patches launch [--max-restarts N]")
    # A rollback with no restart left ends the launcher with the rollback's 84 (what a scheduler reads).
    ran = subprocess.run([str(launch), "launch", "--max-restarts", "0", "--", str(python), "-c", "raise SystemExit(84)"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert ran.returncode == 84, ran.stderr
    assert "the restart budget of 0 is spent; stopping with 84" in ran.stderr
