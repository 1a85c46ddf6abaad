"""Alert sinks against real receivers: an HTTP server on 127.0.0.1, a shell command, a file."""

import json
import logging
import shlex
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_patches.alerts import AlertDispatcher
from megatron_patches.config import AlertsConfig, Config
from megatron_patches.errors import ConfigError
from megatron_patches.incidents import ParamFinding, make_record

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

FC1 = "decoder.layers.3.mlp.linear_fc1.weight"


def incident(step=37, severity="error"):
    param = ParamFinding(
        name=FC1, layer=3, shape=[256, 64], nan=1024, inf=0, overflow=0, norm=None,
        ranks={"global": 3, "tp": 1, "pp": 1, "dp": 0, "cp": 0, "ep": 0, "vpp": 0},
        host="node-1", device="cuda:1", order=20, reasons=["nan"],
    )
    return make_record(
        step=step, severity=severity, kind="nan", kinds=["nan"], action="skip_step", message="NaN in 1 gradient",
        params=[param], ranks_affected=[3], world={"size": 4, "tp": 2, "pp": 2, "dp": 1, "cp": 1, "ep": 1},
    )


def alerts(**fields):
    return Config.from_dict({"alerts": {"backoff_s": 0.05, **fields}}).alerts


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _LoopbackServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


def serve_on_loopback(handler: type) -> ThreadingHTTPServer:
    """``handler`` served on 127.0.0.1 (a free port) from a daemon thread."""
    server = _LoopbackServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Receiver:
    """A webhook receiver. /slow answers only when the test ends; /reject answers like Feishu on a bad token."""

    def __init__(self):
        self.posts = []
        self.release = threading.Event()
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append((self.path, self.headers["Content-Type"], json.loads(body)))
                if self.path.startswith("/slow"):
                    receiver.release.wait(30)
                reply = b'{"code":19001,"msg":"token invalid"}' if self.path == "/reject" else b'{"code":0}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = serve_on_loopback(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def bodies(self, path):
        return [body for p, _, body in self.posts if p == path]

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


def test_each_webhook_format_posts_its_body(receiver, tmp_path):
    config = alerts(webhooks=[{"url": f"{receiver.url}/{fmt}", "format": fmt}
                              for fmt in ("generic", "slack", "feishu", "dingtalk")])
    dispatcher = AlertDispatcher(config, str(tmp_path))
    record = incident()
    dispatcher.submit(record)
    stats = dispatcher.close(timeout=30)
    assert (stats["sent"], stats["failed"], stats["dropped"]) == (4, 0, 0)

    assert receiver.bodies("/generic") == [json.loads(json.dumps(record))]
    assert all(ctype.startswith("application/json") for _, ctype, _ in receiver.posts)
    (slack,) = receiver.bodies("/slack")
    text = slack["text"]
    assert set(slack) == {"text"}
    assert "step 37 error nan" in text and FC1 in text and "global rank 3 (tp 1, pp 1, dp 0)" in text
    assert receiver.bodies("/feishu") == [{"msg_type": "text", "content": {"text": text}}]
    assert receiver.bodies("/dingtalk") == [{"msgtype": "text", "text": {"content": text}}]


def test_unreachable_and_slow_webhooks_only_count_failures(receiver, tmp_path, caplog):
    config = alerts(webhooks=[
        {"url": closed_port_url(), "retries": 1},
        {"url": f"{receiver.url}/slow-secret-token", "timeout_s": 0.3, "retries": 0},
    ])
    dispatcher = AlertDispatcher(config, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="megatron_patches.alerts"):
        dispatcher.submit(incident())  # returns at once; the training thread goes on
        assert dispatcher.stats["sent"] == 0
        stats = dispatcher.close(timeout=30)
    assert (stats["sent"], stats["failed"], stats["dropped"]) == (0, 2, 0)
    assert "not delivered to webhook[0] generic 127.0.0.1 after 2 attempt(s): cannot connect" in caplog.text
    assert "not delivered to webhook[1] generic 127.0.0.1 after 1 attempt(s): no answer within timeout_s=0.3" \
        in caplog.text
    assert "secret-token" not in caplog.text  # webhook paths hold tokens and are never logged


def test_full_queue_drops_the_oldest(receiver, tmp_path):
    config = alerts(queue_size=2, webhooks=[{"url": f"{receiver.url}/slow", "timeout_s": 0.2, "retries": 0}])
    dispatcher = AlertDispatcher(config, str(tmp_path))
    for step in range(1, 6):
        dispatcher.submit(incident(step=step))
    stats = dispatcher.close(timeout=30)
    assert stats["dropped"] >= 2
    assert stats["failed"] + stats["dropped"] == 5
    steps = [body["step"] for body in receiver.bodies("/slow")]
    assert 5 in steps and len(steps) == stats["failed"]


def test_rejection_in_a_200_reply_is_a_failure(receiver, tmp_path, caplog):
    dispatcher = AlertDispatcher(alerts(webhooks=[{"url": f"{receiver.url}/reject", "format": "feishu",
                                                   "retries": 0}]), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="megatron_patches.alerts"):
        dispatcher.submit(incident())
        stats = dispatcher.close(timeout=30)
    assert stats["failed"] == 1
    assert "rejected by the receiver: code=19001 token invalid" in caplog.text


def test_command_receives_the_incident_on_stdin(tmp_path):
    out = tmp_path / "alert.json"
    command = "sh -c " + shlex.quote(f"cat > {shlex.quote(str(out))}")
    dispatcher = AlertDispatcher(alerts(command=command), str(tmp_path))
    record = incident()
    dispatcher.submit(record)
    assert dispatcher.close(timeout=30)["sent"] == 1
    written = json.loads(out.read_text())
    assert written["first"]["name"] == FC1 and written["first"]["ranks"]["global"] == 3
    assert written == json.loads(json.dumps(record))


def test_failing_and_hanging_commands_are_counted(tmp_path, caplog):
    failing = AlertDispatcher(alerts(command="echo no route to pager >&2; exit 3", command_retries=1), str(tmp_path))
    hanging = AlertDispatcher(alerts(command="sleep 60", command_timeout_s=0.3), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="megatron_patches.alerts"):
        failing.submit(incident())
        hanging.submit(incident())
        assert failing.close(timeout=30)["failed"] == 1
        assert hanging.close(timeout=30)["failed"] == 1
    assert "after 2 attempt(s): exited with status 3: no route to pager" in caplog.text
    assert "timed out after 0.3s (alerts.command_timeout_s); killed" in caplog.text


def test_severity_routing_and_jsonl_under_report_dir(tmp_path, caplog):
    dispatcher = AlertDispatcher(alerts(jsonl="alerts.jsonl", min_severity="critical"), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="megatron_patches.alerts"):
        dispatcher.submit(incident(step=1, severity="warning"))
        dispatcher.submit(incident(step=2, severity="error"))
        dispatcher.submit(incident(step=3, severity="critical"))
        stats = dispatcher.close(timeout=30)
    assert stats["sent"] == 1
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("incident")]
    assert [m.split()[2] for m in logged] == ["1", "2", "3"]  # every severity is logged


def test_submit_never_raises(tmp_path, caplog):
    dispatcher = AlertDispatcher(alerts(jsonl="alerts.jsonl"), str(tmp_path))
    bad = incident()
    bad["first"]["norm"] = float("nan")  # not valid JSON
    with caplog.at_level(logging.ERROR, logger="megatron_patches.alerts"):
        dispatcher.submit(bad)
    dispatcher.close(timeout=30)
    dispatcher.submit(incident())  # after close: logged and counted, not raised
    assert dispatcher.stats["failed"] == 1 and dispatcher.stats["dropped"] == 1
    assert "could not be serialized" in caplog.text


def test_alerts_config_rejects_what_cannot_work():
    assert Config().alerts == AlertsConfig()
    with pytest.raises(ConfigError, match=r"every entry of `alerts.webhooks` needs a `url`"):
        Config.from_dict({"alerts": {"webhooks": [{"format": "slack"}]}})
    with pytest.raises(ConfigError, match=r"`alerts.webhooks\[0\].format` must be one of 'generic', 'slack'"):
        Config.from_dict({"alerts": {"webhooks": [{"url": "https://x.example", "format": "teams"}]}})
    with pytest.raises(ConfigError, match=r"unknown config key alerts.webhooks\[0\].timeout "):
        Config.from_dict({"alerts": {"webhooks": [{"url": "https://x.example", "timeout": 3}]}})
    with pytest.raises(ConfigError, match=r"`alerts.queue_size` must be >= 1, got 0"):
        Config.from_dict({"alerts": {"queue_size": 0}})


class SlowReceiver:
    """A webhook on 127.0.0.1 that leaves the first ``slow`` POSTs unanswered for ``delay`` seconds
    (longer than the sender's timeout), then answers at once. Bounded: every wait ends by itself."""

    def __init__(self, slow, delay):
        self.answered, self.seen = [], 0
        receiver = self
        lock = threading.Lock()

        class Handler(QuietHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    receiver.seen += 1
                    late = receiver.seen <= slow
                if late:
                    threading.Event().wait(delay)  # the client has given up by then
                    return
                receiver.answered.append((time.monotonic(), body))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = serve_on_loopback(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_stopping_close_waits_what_timeouts_and_retries_need(tmp_path):
    # Two attempts time out (4 s each) and back off (1 s, 2 s); the third is answered about 11 s
    # after the alert was queued, past the 10 s close() used to wait. Without a timeout it waits
    # what the configuration needs: 3 x 4 + 1 + 2 = 15 s.
    receiver = SlowReceiver(slow=2, delay=5)
    try:
        dispatcher = AlertDispatcher(alerts(backoff_s=1.0, webhooks=[
            {"url": receiver.url, "timeout_s": 4, "retries": 2}]), str(tmp_path))
        dispatcher.submit(incident(severity="critical"))
        assert dispatcher.needed_s() == pytest.approx(15.0)
        start = time.monotonic()
        stats = dispatcher.close()
        waited = time.monotonic() - start
    finally:
        receiver.stop()
    assert (stats["sent"], stats["failed"], stats["dropped"]) == (1, 0, 0)
    assert [body["severity"] for _, body in receiver.answered] == ["critical"]
    assert 10.0 < waited < 15.0, waited


def test_close_is_capped_and_a_lost_alert_is_logged(tmp_path, caplog):
    # The endpoint never answers in time: the budget (4 x 1 s + pauses) is over the limit of 2 s.
    receiver = SlowReceiver(slow=100, delay=3)
    try:
        dispatcher = AlertDispatcher(alerts(backoff_s=0.5, webhooks=[
            {"url": receiver.url, "timeout_s": 1, "retries": 3}]), str(tmp_path))
        with caplog.at_level(logging.WARNING, logger="megatron_patches.alerts"):
            dispatcher.submit(incident(step=41, severity="critical"))
            assert dispatcher.needed_s() > 2.0
            start = time.monotonic()
            dispatcher.close(limit=2.0)
            waited = time.monotonic() - start
    finally:
        receiver.stop()
    assert waited < 2.5, waited
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("alert for step 41 not confirmed by webhook[0] generic 127.0.0.1" in m for m in errors), errors
    assert "/hook" not in caplog.text


@pytest.mark.process
def test_the_alert_of_a_stopping_exit_leaves(tmp_path):
    # A real run stops on its first error (exit 85). The webhook answers after 11 s, inside its
    # 13 s timeout but past the 10 s the exit used to wait: the alert must still arrive.
    from conftest import run_tiny

    receiver = SlowReceiver(slow=0, delay=0)
    receiver_delay = threading.Event()
    original = receiver.server.RequestHandlerClass.do_POST

    def late_post(handler):
        receiver_delay.wait(11)
        original(handler)

    receiver.server.RequestHandlerClass.do_POST = late_post
    config = tmp_path / "guard.yaml"
    config.write_text("response:\n  persist_steps: 1\n  on_error: stop\n  replay: false\n"
                      f"alerts:\n  webhooks:\n    - url: {receiver.url}\n      timeout_s: 13\n      retries: 0\n")
    try:
        run = run_tiny(tmp_path / "out", "--steps", "6", "--config", str(config),  # the exit is the subject
                       "--inject", "nan:step=3,param=decoder.layers.1.mlp.linear_fc1.weight", process=True)
    finally:
        receiver.stop()
    assert run.returncode == 85, run.output[-3000:]
    assert [(body["step"], body["severity"], body["action"]) for _, body in receiver.answered] == [(3, "error", "stop")]
    assert "alerts at close: 1 delivered, 0 failed, 0 dropped" in run.output, run.output[-3000:]
    assert "not confirmed" not in run.output and "not delivered" not in run.output
