"""Send error and critical incidents to people: a JSONL file, a shell command, webhooks.

``AlertDispatcher.submit(record)`` is what the training thread calls. It writes one log
line (every severity) and, for severities at or above ``alerts.min_severity``, puts the
serialized record on a bounded queue; nothing else happens on the caller's thread. A daemon
thread delivers each alert to every sink, each with its own timeout and bounded retries, so a
slow or unreachable endpoint costs alerts, never training time. When the queue is full the
oldest alert is dropped and counted. ``close()`` drains what is queued: it waits as long as the
sinks' configured timeouts, retries and back-off pauses need for the alerts still to go (see
:meth:`AlertDispatcher.needed_s`), at most :data:`EXIT_LIMIT_S`; an alert that did not leave by
then is logged as an error with its step and sink.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from .config import AlertsConfig, WebhookConfig
from .incidents import JsonlWriter, _jsonable
from .incident_text import diagnosis, one_line

log = logging.getLogger(__name__)

_RANK = {"warning": 0, "error": 1, "critical": 2}

EXIT_LIMIT_S = 60.0
"""The longest ``close()`` waits for queued alerts when the job stops (``monitor.exit``, the end of
training): the critical-stop alert is the one most worth sending, but a dead endpoint must not hold
every rank at the final barrier. One default webhook (timeout 5 s, 2 retries, back-off 1 s) needs
18 s."""


class SinkError(Exception):
    """One delivery attempt failed; the message says why (never the webhook URL)."""


def chat_text(record: dict) -> str:
    """The plain-text body used by the chat formats."""
    return "[megatron_patches] " + "\n".join(diagnosis(record))


def webhook_body(fmt: str, record: dict) -> dict:
    """The JSON body POSTed for ``fmt`` (generic, slack, feishu, dingtalk)."""
    if fmt == "generic":
        return record
    text = chat_text(record)
    if fmt == "slack":
        return {"text": text}
    if fmt == "feishu":
        return {"msg_type": "text", "content": {"text": text}}
    if fmt == "dingtalk":
        return {"msgtype": "text", "text": {"content": text}}
    raise ValueError(f"unknown webhook format {fmt!r}; use generic, slack, feishu or dingtalk")


class _Sink:
    name = "sink"
    retries = 0
    timeout_s = 1.0
    """The longest one attempt may take (a file append: about nothing)."""

    def send(self, payload: bytes, record: dict) -> None:
        raise NotImplementedError


class JsonlSink(_Sink):
    def __init__(self, path: str):
        self.name = f"jsonl {path}"
        self._writer = JsonlWriter(path, fsync=False, strict=True)

    def send(self, payload: bytes, record: dict) -> None:
        try:
            self._writer.write(record)
        except OSError as exc:
            raise SinkError(f"cannot append to {self._writer.path}: {exc.strerror or exc}") from None


class CommandSink(_Sink):
    def __init__(self, command: str, timeout_s: float, retries: int):
        self.name = "command " + (command.split() or ["?"])[0]
        self.command, self.timeout_s, self.retries = command, timeout_s, retries

    def send(self, payload: bytes, record: dict) -> None:
        proc = subprocess.Popen(
            self.command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            _, err = proc.communicate(payload, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise SinkError(f"timed out after {self.timeout_s:g}s (alerts.command_timeout_s); killed") from None
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no stderr"]
            raise SinkError(f"exited with status {proc.returncode}: {tail[0]}")


class WebhookSink(_Sink):
    def __init__(self, index: int, config: WebhookConfig):
        host = urllib.parse.urlsplit(config.url).hostname or "?"
        self.name = f"webhook[{index}] {config.format} {host}"  # the path often holds a token
        self.config, self.retries, self.timeout_s = config, config.retries, config.timeout_s

    def send(self, payload: bytes, record: dict) -> None:
        if self.config.format != "generic":
            payload = json.dumps(webhook_body(self.config.format, record)).encode("utf-8")
        request = urllib.request.Request(
            self.config.url, data=payload, method="POST",
            headers={"Content-Type": "application/json; charset=utf-8", "User-Agent": "megatron_patches"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                body = response.read(65536)
        except urllib.error.HTTPError as exc:
            raise SinkError(f"HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise SinkError(f"no answer within timeout_s={self.config.timeout_s:g}") from None
            raise SinkError(f"cannot connect: {reason}") from None
        _check_chat_reply(body)


def _check_chat_reply(body: bytes) -> None:
    """Feishu and DingTalk answer HTTP 200 with an error code in the body; treat that as failure."""
    try:
        reply = json.loads(body)
    except ValueError:
        return
    if isinstance(reply, dict):
        for key in ("code", "errcode", "StatusCode"):
            if reply.get(key) not in (None, 0):
                detail = reply.get("msg") or reply.get("errmsg") or reply.get("StatusMessage") or ""
                raise SinkError(f"rejected by the receiver: {key}={reply[key]} {detail}".rstrip())


def build_sinks(config: AlertsConfig, report_dir: str) -> list[_Sink]:
    sinks: list[_Sink] = []
    if config.jsonl:
        sinks.append(JsonlSink(os.path.join(report_dir, config.jsonl)))
    if config.command:
        sinks.append(CommandSink(config.command, config.command_timeout_s, config.command_retries))
    sinks.extend(WebhookSink(i, hook) for i, hook in enumerate(config.webhooks))
    return sinks


class AlertDispatcher:
    """Delivers alerts off the training thread. Create one on the rank that writes incidents."""

    def __init__(self, config: Optional[AlertsConfig] = None, report_dir: str = "."):
        self.config = config or AlertsConfig()
        self.sinks = build_sinks(self.config, report_dir)
        self._queue: collections.deque[tuple[bytes, dict]] = collections.deque()
        self._cond = threading.Condition()
        self._abort = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._current: Optional[tuple[Any, str]] = None  # (step, sink name) being delivered now
        self._counts = {"sent": 0, "failed": 0, "dropped": 0}
        self._by_sink = {s.name: {"sent": 0, "failed": 0} for s in self.sinks}

    @property
    def stats(self) -> dict[str, Any]:
        """Deliveries: sent and failed per (alert, sink); dropped = alerts that never left the queue."""
        with self._cond:
            return {**self._counts, "queued": len(self._queue),
                    "by_sink": {k: dict(v) for k, v in self._by_sink.items()}}

    def submit(self, record: dict) -> None:
        """Log the incident and queue it for the sinks. Never blocks on I/O and never raises."""
        try:
            severity = str(record.get("severity", "error"))
            level = logging.WARNING if severity == "warning" else logging.ERROR
            log.log(level, "incident %s", one_line(record))
            if not self.sinks or _RANK.get(severity, 1) < _RANK[self.config.min_severity]:
                return
            payload = json.dumps(record, allow_nan=False, default=_jsonable).encode("utf-8")
            snapshot = json.loads(payload)
        except Exception as exc:  # an alert must never take training down
            log.error("alert not queued: the incident could not be serialized (%s)", exc)
            with self._cond:
                self._counts["failed"] += 1
            return
        with self._cond:
            if self._closed:
                self._counts["dropped"] += 1
                log.warning("alert for step %s not sent: the dispatcher is closed", record.get("step"))
                return
            if len(self._queue) >= self.config.queue_size:
                self._queue.popleft()
                self._counts["dropped"] += 1
                dropped = self._counts["dropped"]
                if dropped == 1 or dropped % 100 == 0:
                    log.warning("alert queue full (alerts.queue_size=%d): dropped the oldest, %d dropped so far",
                                self.config.queue_size, dropped)
            self._queue.append((payload, snapshot))
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="megatron_patches-alerts", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # e.g. "can't start new thread" under a thread limit
                    self._queue.clear()
                    self._counts["failed"] += 1
                    log.error("alert for step %s not sent: no sender thread (%s)", record.get("step"), exc)
                    return
                self._thread = thread
            self._cond.notify()

    def needed_s(self) -> float:
        """Seconds the alerts not yet delivered may take at worst: for each (the one in flight
        included), every sink's attempts at their timeout plus the back-off pauses between them."""
        per_alert = sum((sink.retries + 1) * sink.timeout_s + self.config.backoff_s * (2 ** sink.retries - 1)
                        for sink in self.sinks)
        with self._cond:
            waiting = len(self._queue) + (self._current is not None)
        return waiting * per_alert

    def close(self, timeout: Optional[float] = None, limit: float = EXIT_LIMIT_S) -> dict[str, Any]:
        """Stop taking alerts and deliver what is queued. ``timeout``: seconds to wait; default what
        :meth:`needed_s` says (plus a second), at most ``limit``. What did not leave is logged."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if timeout is None:
            timeout = min(self.needed_s() + 1.0, limit)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._abort.set()  # stop retry pauses; an attempt in flight ends at its own timeout
        with self._cond:
            left = len(self._queue)
            self._queue.clear()
            self._counts["dropped"] += left
            current = self._current if thread is not None and thread.is_alive() else None
        if current is not None:
            log.error("alert for step %s not confirmed by %s within the %gs the exit waits for alerts; "
                      "it may be lost (raise the limit or fix the endpoint)", current[0], current[1], timeout)
        if left:
            log.error("%d alert(s) not sent before the close deadline of %gs; they are lost", left, timeout)
        stats = self.stats
        if stats["sent"] or stats["failed"] or stats["dropped"]:
            log.info("alerts at close: %d delivered, %d failed, %d dropped (deliveries per sink)",
                     stats["sent"], stats["failed"], stats["dropped"])
        return stats

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue or self._abort.is_set():
                    return
                payload, record = self._queue.popleft()
                self._current = (record.get("step"), self.sinks[0].name if self.sinks else "?")
            for sink in self.sinks:
                with self._cond:
                    self._current = (record.get("step"), sink.name)
                ok = not self._abort.is_set() and self._deliver(sink, payload, record)
                with self._cond:
                    key = "sent" if ok else "failed"
                    self._counts[key] += 1
                    self._by_sink[sink.name][key] += 1
            with self._cond:
                self._current = None

    def _deliver(self, sink: _Sink, payload: bytes, record: dict) -> bool:
        pause, attempts, last = self.config.backoff_s, 0, ""
        while True:
            attempts += 1
            try:
                sink.send(payload, record)
                return True
            except Exception as exc:  # a broken sink must not end the worker
                last = str(exc) if isinstance(exc, SinkError) else f"{type(exc).__name__}: {exc}"
            if attempts > sink.retries or self._abort.wait(pause):
                break
            pause *= 2
        log.warning("alert for step %s not delivered to %s after %d attempt(s): %s",
                    record.get("step"), sink.name, attempts, last)
        return False

