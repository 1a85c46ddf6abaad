"""``megatron-patches``: read a run's incidents (``report``), check a setup (``doctor``) and restart a
training after a rollback (``launch``).

Bad input ends with one line on stderr and a non-zero exit, never a traceback:
2 for unusable input, 1 when ``doctor`` found a FAIL.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import warnings
from typing import Any, Optional

from . import __version__, versions
from .errors import UserError

PROG = "megatron-patches"


def cmd_report(args: argparse.Namespace) -> int:
    from . import report as rpt
    from .incidents import finite_json

    loaded = rpt.load_report(args.dir, with_history=bool(args.plot))
    for problem in loaded.problems:
        print(f"{PROG} report: {problem}", file=sys.stderr)
    if args.json:
        # Strict JSON: NaN and Infinity (which json.dumps would print bare) become null.
        print(json.dumps(finite_json(rpt.summary(loaded)), indent=2, allow_nan=False))
    else:
        print(rpt.format_text(loaded))
    if args.plot:
        rpt.plot(loaded, args.plot)
        print(f"{PROG} report: wrote {args.plot}", file=sys.stderr)
    return 0


# --- doctor -----------------------------------------------------------------------------


class _Checks:
    def __init__(self) -> None:
        self.failed = False

    def line(self, status: str, what: str, detail: str) -> None:
        self.failed |= status == "FAIL"
        print(f"{status:<5} {what:<16} {detail}")


def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def _megatron_core() -> tuple[Optional[str], Optional[str]]:
    """(version, package directory) of the megatron.core that ``import`` would load."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:
        return None, None
    if spec is None or not spec.origin:
        return None, None
    location = os.path.dirname(spec.origin)
    try:
        dist = importlib.metadata.distribution("megatron-core")
        root = os.path.realpath(str(dist.locate_file("")))
        if os.path.realpath(location).startswith(root + os.sep):
            return dist.version, location
    except importlib.metadata.PackageNotFoundError:
        pass
    from .seams.parallel import megatron_core_version

    with warnings.catch_warnings():  # a source checkout: ask the package itself (slow import)
        warnings.simplefilter("ignore")
        return megatron_core_version(), location


def _check_megatron(checks: _Checks) -> None:
    try:
        version, location = _megatron_core()
    except Exception as exc:
        checks.line("FAIL", "megatron-core", f"cannot be inspected: {_exc(exc)}")
        return
    if version is None:
        checks.line("FAIL", "megatron-core", "not installed: pip install "
                    f"'{versions.requirement()}'")
        return
    try:
        from .seams.targets import MEGATRON_CORE_SUPPORTED
    except Exception as exc:
        checks.line("warn", "megatron-core", f"{version} at {location}; supported range unknown "
                    f"(megatron_patches.seams.targets not importable: {_exc(exc)})")
        return
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        inside = Version(version) in SpecifierSet(MEGATRON_CORE_SUPPORTED)
    except InvalidVersion:
        checks.line("warn", "megatron-core", f"version {version!r} at {location} cannot be compared "
                    f"with the supported range {MEGATRON_CORE_SUPPORTED}")
        return
    if inside:
        checks.line("ok", "megatron-core", f"{version} (supported: {MEGATRON_CORE_SUPPORTED}) at {location}")
    else:
        checks.line("FAIL", "megatron-core", f"{version} is outside the supported range {MEGATRON_CORE_SUPPORTED}; "
                    f"install one inside it ({versions.supported_lines()}), e.g. "
                    f"pip install '{versions.requirement()}'")


def _check_npu(checks: _Checks) -> Any:
    """The imported torch_npu module, or None."""
    cann_env = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if importlib.util.find_spec("torch_npu") is None:
        if cann_env:
            checks.line("warn", "torch_npu", f"not installed, but CANN is set up at {cann_env}: "
                        f"pip install 'megatron_patches[npu]' to train on the NPUs")
        else:
            checks.line("ok", "torch_npu", "not installed (only needed on Ascend NPUs)")
        return None
    try:
        import torch_npu
    except Exception as exc:
        checks.line("FAIL", "torch_npu", f"installed but does not import ({_exc(exc)}); "
                    f"source CANN's set_env.sh first")
        return None
    cann = "unknown"
    try:
        cann = torch_npu.npu.utils.get_cann_version() or cann
    except Exception:
        import torch

        cann = getattr(torch.version, "cann", None) or cann
    try:
        devices = f"{torch_npu.npu.device_count()} NPU(s)" if torch_npu.npu.is_available() else "no NPU visible"
    except Exception as exc:
        devices = f"NPU query failed: {_exc(exc)}"
    version = getattr(torch_npu, "__version__", "?")
    checks.line("ok", "torch_npu", f"{version}, CANN {cann}, {devices}")
    return torch_npu


def _overflow_mode(configured: str, torch_npu: Any) -> tuple[str, str]:
    if configured != "auto":
        return "ok", f"{configured} (set in the config)"
    if torch_npu is None:
        return "ok", "auto -> ieee (torch_npu absent)"
    probe = getattr(getattr(torch_npu.npu, "utils", None), "is_support_inf_nan", None)
    if probe is None:
        return "warn", "auto, but this torch_npu cannot say (no is_support_inf_nan); set overflow_mode explicitly"
    try:
        return "ok", ("auto -> " + ("ieee (INF_NAN mode)" if probe() else "saturation (the NPU clamps overflow)")
                      + " on this NPU; a job asks at its first check, on each rank's own device")
    except Exception as exc:
        return "warn", f"auto, but torch_npu's is_support_inf_nan failed ({_exc(exc)}); set overflow_mode explicitly"


def _check_report_dir(checks: _Checks, report_dir: str) -> None:
    """Writable means a file can be created there; a missing directory, that it can be made."""
    path = os.path.abspath(report_dir)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        checks.line("FAIL", "report_dir", f"{path} cannot be created: {probe} is a file; set report_dir elsewhere")
        return
    try:
        if probe == path:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=probe))
    except OSError as exc:
        what = "is not writable" if probe == path else f"cannot be created in {probe}"
        checks.line("FAIL", "report_dir", f"{path} {what} ({exc.strerror or exc}); set report_dir elsewhere")
        return
    checks.line("ok", "report_dir", f"{path} ({'writable' if probe == path else 'will be created'})")


def _alerts_summary(alerts: Any) -> str:
    import urllib.parse

    sinks = ["log"]
    if alerts.jsonl:
        sinks.append(f"jsonl {alerts.jsonl}")
    if alerts.command:
        sinks.append("command")
    sinks += [f"{h.format} webhook to {urllib.parse.urlsplit(h.url).hostname}" for h in alerts.webhooks]
    return f"{' + '.join(sinks)} for {alerts.min_severity} and above"


def cmd_doctor(args: argparse.Namespace) -> int:
    from .config import ENV_VAR, load_config
    from .errors import ConfigError

    checks = _Checks()
    py_ok = sys.version_info >= versions.PYTHON_MIN
    checks.line("ok" if py_ok else "FAIL", "python", f"{platform.python_version()} ({sys.executable})"
                + ("" if py_ok else f"; megatron_patches needs Python >= {versions.python_min()}"))
    checks.line("ok", "megatron_patches", f"{__version__} at {os.path.dirname(os.path.abspath(__file__))}")

    source = args.config or os.environ.get(ENV_VAR) or None
    config = None
    try:
        config = load_config(args.config)
        where = f"{source}" if source else f"defaults (no --config, {ENV_VAR} unset)"
        checks.line("ok" if config.enabled else "warn", "config",
                    where + ("" if config.enabled else "; enabled: false, so nothing will be installed"))
    except ConfigError as exc:
        checks.line("FAIL", "config", str(exc))

    torch = None
    try:
        import torch
    except Exception as exc:
        checks.line("FAIL", "torch", f"does not import ({_exc(exc)}): pip install 'torch>=2.3'")
    if torch is not None:
        checks.line("ok", "torch", torch.__version__)
        _check_megatron(checks)
        torch_npu = _check_npu(checks)
        cuda = torch.cuda.is_available()
        if cuda:
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            checks.line("ok", "cuda", f"{torch.cuda.device_count()} device(s): {', '.join(names)}")
        elif torch_npu is not None:
            checks.line("ok", "cuda", "not available (training runs on the NPUs)")
        else:
            checks.line("warn", "cuda", "no CUDA device and no torch_npu: training would run on the CPU only")
        if importlib.util.find_spec("amp_C") is None:
            checks.line("warn" if cuda else "ok", "apex (amp_C)",
                        "not installed; megatron-core falls back to slower torch kernels"
                        + ("" if cuda else " (only used on CUDA)"))
        else:
            try:
                import amp_C  # noqa: F401

                checks.line("ok", "apex (amp_C)", "fused kernels import")
            except Exception as exc:
                checks.line("warn", "apex (amp_C)", f"installed but does not import ({_exc(exc)}); "
                            f"megatron-core falls back to torch kernels")
        if config is not None:
            status, detail = _overflow_mode(config.overflow_mode, torch_npu)
            checks.line(status, "overflow_mode", detail)

    if config is not None:
        _check_report_dir(checks, config.report_dir)
        checks.line("ok", "alerts", _alerts_summary(config.alerts))
    else:
        checks.line("warn", "report_dir", "not checked: the config did not load")
    print("FAIL: fix the lines marked FAIL before training" if checks.failed else "no FAIL: ready")
    return 1 if checks.failed else 0


# --- entry ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].replace("``", "").split()))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{report,doctor,launch}")

    rep = sub.add_parser("report", help="explain the incidents recorded in a report directory")
    rep.add_argument("dir", metavar="DIR", help="a run's report_dir (holds incidents.jsonl)")
    rep.add_argument("--json", action="store_true", help="print a machine-readable summary instead")
    rep.add_argument("--plot", metavar="FILE.png", help="also draw gradient norms per layer (needs matplotlib)")
    rep.set_defaults(func=cmd_report)

    doc = sub.add_parser("doctor", help="check the environment and config before training")
    doc.add_argument("--config", metavar="FILE", help="YAML config to check (default: $MEGATRON_PATCHES_CONFIG)")
    doc.set_defaults(func=cmd_doctor)

    # Listed for --help only: main() hands everything after `launch` to megatron_patches.launch,
    # whose own parser takes the command after `--` verbatim.
    sub.add_parser("launch", add_help=False, help="run a training command and restart it after a rollback "
                   "(exit 84): launch [--max-restarts N] -- torchrun ...")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from . import launch

        return launch.main(argv[1:], prog=f"{PROG} launch")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
