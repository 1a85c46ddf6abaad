"""Fault scenes: what was on each rank when an incident happened, saved off the training thread.

Each rank writes ``<report_dir>/scenes/step0000012/rank00003/`` (``step0000012-r1/`` when the step
is reached again after the first rollback, so every episode keeps its scene) holding ``scene.pt`` (RNG
states, batch sample indices and tokens, per-parameter gradient norms, optimizer and scaler
metadata) and ``MANIFEST.json`` (file sizes; written last). Rank 0 adds ``environment.json``
and the incident record. Everything is written into a ``.tmp-`` directory and renamed at the
end, so a crash never leaves a bundle that reads as complete: a rank directory without the
``.tmp-`` prefix always has every file its manifest lists.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import platform
import queue
import sys
import threading
from typing import Any, Optional

import torch

from .files import atomic_directory

log = logging.getLogger("megatron_patches")

SCENES_DIR = "scenes"
MANIFEST = "MANIFEST.json"
_ENV_PREFIXES = ("MEGATRON", "NCCL_", "HCCL_", "CUDA_", "ASCEND_", "NPU_", "TORCH_", "OMP_", "MASTER_",
                 "WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTORCH_", "CUBLAS_", "NVTE_")


def scene_dir(report_dir: str, step: int, rank: int, episode: int = 0) -> str:
    """Where ``rank`` writes its scene of ``step``; ``episode``: rollbacks done before it (the
    same on every rank), so an incident at a step reached again does not replace the first one's."""
    name = f"step{step:07d}" + (f"-r{episode}" if episode else "")
    return os.path.join(report_dir, SCENES_DIR, name, f"rank{rank:05d}")


def environment(megatron_core: Optional[str]) -> dict:
    """Versions, devices and the environment variables that change numerics or communication;
    ``megatron_core``: its version (``Seams.megatron_core_version``)."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "env": {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)},
        "megatron_core": megatron_core,
    }
    if torch.cuda.is_available():
        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda_driver"] = getattr(torch.cuda, "driver_version", lambda: None)() if hasattr(torch.cuda, "driver_version") else None
    try:
        import torch_npu  # type: ignore

        env["torch_npu"] = torch_npu.__version__
        get_cann = getattr(getattr(torch_npu.npu, "utils", None), "get_cann_version", None)
        env["cann"] = get_cann() if get_cann else None
    except Exception:
        env["torch_npu"] = None
    return env


def list_complete(report_dir: str) -> list[str]:
    """Rank bundles that finished writing (what a reader may trust)."""
    root = os.path.join(report_dir, SCENES_DIR)
    done = []
    for step_name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        step_dir = os.path.join(root, step_name)
        for rank_name in sorted(os.listdir(step_dir)):
            path = os.path.join(step_dir, rank_name)
            if rank_name.startswith("rank") and os.path.isfile(os.path.join(path, MANIFEST)):
                done.append(path)
    return done


class SceneWriter:
    """A daemon thread writing bundles from a bounded queue; full queue -> dropped and counted."""

    def __init__(self, queue_size: int = 4, max_bytes: int = 64 * 2**20):
        self.max_bytes = max_bytes
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue(maxsize=queue_size)
        self.written = 0
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="megatron_patches-scenes", daemon=True)
        self._thread.start()

    def submit(self, path: str, payload: dict, files_json: Optional[dict] = None) -> bool:
        """Queue one bundle; ``payload`` must already be CPU copies (the training thread goes on).
        ``files_json`` (the incident record among them) is deep-copied here: whatever the caller
        does with its objects afterwards, the bundle holds them as they were at submission."""
        try:
            self._queue.put_nowait((path, payload, copy.deepcopy(files_json or {})))
            return True
        except queue.Full:
            self.dropped += 1
            log.warning("fault scene for %s dropped: %d bundles already waiting", path, self._queue.qsize())
            return False

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (up to ``timeout`` seconds), then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                write_bundle(*item, max_bytes=self.max_bytes)
                self.written += 1
            except Exception as exc:  # a failed bundle must never take training down
                self.failed += 1
                log.warning("fault scene %s not written: %s", item[0], exc)


def write_bundle(path: str, payload: dict, files_json: dict, max_bytes: int = 64 * 2**20) -> None:
    """Write one rank's bundle atomically (:func:`files.atomic_directory`: a ``.tmp-`` directory
    renamed when complete, removed on failure so a full disk gets its space back for the records)."""
    with atomic_directory(path) as tmp:
        _write_into(tmp, payload, files_json, max_bytes)


def _write_into(tmp: str, payload: dict, files_json: dict, max_bytes: int) -> None:
    if _size(payload) > max_bytes and "tokens" in payload.get("batch", {}):
        payload = {**payload, "batch": {**payload["batch"], "tokens": None, "tokens_dropped": "over max_bytes"}}
    sizes = {}
    scene_pt = os.path.join(tmp, "scene.pt")
    torch.save(payload, scene_pt)
    sizes["scene.pt"] = os.path.getsize(scene_pt)
    for filename, obj in files_json.items():
        target = os.path.join(tmp, filename)
        with open(target, "w", encoding="utf-8") as handle:
            json.dump(obj, handle, indent=1, default=str)
        sizes[filename] = os.path.getsize(target)
    for filename in sizes:
        with open(os.path.join(tmp, filename), "rb") as handle:
            os.fsync(handle.fileno())
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as handle:
        json.dump({"files": sizes}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _size(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_size(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_size(v) for v in obj)
    return 64


def capture(report_dir: str, ctx: Any, findings: list, batch: dict, optimizer: Any, meta: dict,
            overflow_mode: str, rank: int, episode: int, rng: dict, ranks: dict[str, int]) -> tuple[str, dict]:
    """This rank's scene of the check ``ctx`` as it is now: (path, payload) of CPU copies, nothing
    shared with training. ``batch``: the record's batch fields with ``samples`` and ``tokens``
    (this rank's micro-batch tensors, or None); ``meta``: the guard's step and rollbacks, to which
    the optimizer's param groups and loss scale are added; ``rng``: every RNG's state
    (``Seams.rng_state``); ``ranks``: this rank's (:func:`~megatron_patches.naming.rank_info`)."""
    from . import naming

    norms = ctx.norms.tolist() if ctx.norms is not None else []
    tokens = batch.get("tokens")
    payload = {
        "step": ctx.step,
        "ranks": ranks,
        "host": naming.host(),
        "device": naming.device_name(),
        "batch": {**batch, "tokens": [t.detach().cpu().clone() for t in tokens] if tokens else None},
        "rng": rng,
        "grad_norms": {e.info.name: n for e, n in zip(ctx.entries, norms)},
        "findings": [f.as_record() for f in findings],
        "optimizer": _optimizer_meta(optimizer, meta),
        "overflow_mode": overflow_mode,
    }
    # Each episode keeps its own scene: a step reached again after a rollback is another one.
    return scene_dir(report_dir, ctx.step, rank, episode=episode), payload


def _optimizer_meta(optimizer: Any, meta: dict) -> dict:
    meta = dict(meta)
    if optimizer is None:
        return meta
    meta["param_groups"] = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, type(None)))}
                            for g in optimizer.param_groups]
    scale = optimizer.get_loss_scale() if hasattr(optimizer, "get_loss_scale") else None
    meta["loss_scale"] = float(scale) if scale is not None else None
    return meta
