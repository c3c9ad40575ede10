"""Cancelling a request in progress (servers.Call), against a real HTTP server on this host that answers late: the
waiting thread is woken with a ServerError at once, and an uncancelled request still gets its reply."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from rlstream.schemas.records import SamplingParams
from rlstream.engine.servers import Call, OpenAICompletionsAPI, ServerError


class Slow(http.server.BaseHTTPRequestHandler):
    """Answers a completion after ``delay`` seconds."""

    delay = 3.0
    received = threading.Event()  # a request came in and waits for its answer

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        Slow.received.set()
        time.sleep(self.delay)
        body = json.dumps({"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]},
                                        "finish_reason": "length"}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client went away

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_cancelled_request_wakes_its_caller_at_once(server):
    api, call, out = OpenAICompletionsAPI(server, timeout_s=30), Call(), []

    def send():
        try:
            api.generate([1, 2], SamplingParams(max_tokens=1), call=call)
            out.append("replied")
        except ServerError as exc:
            out.append(exc)

    Slow.received.clear()
    thread = threading.Thread(target=send)
    thread.start()
    assert Slow.received.wait(30), "the request never reached the server"
    call.cancel()
    thread.join(30)
    # Woken by the cancel: the answer (after Slow.delay) would have made it "replied".
    assert out and isinstance(out[0], ServerError) and call.cancelled, out


def test_a_request_cancelled_before_it_connects_is_never_answered(server):
    call = Call()
    call.cancel()
    with pytest.raises(ServerError):
        OpenAICompletionsAPI(server, timeout_s=30).generate([1], SamplingParams(max_tokens=1), call=call)


def test_an_uncancelled_request_gets_its_reply(server):
    Slow.delay = 0.1
    try:
        gen, _ = OpenAICompletionsAPI(server, timeout_s=30).generate([1], SamplingParams(max_tokens=1), call=Call())
    finally:
        Slow.delay = 3.0
    assert gen.token_ids == [7] and gen.logprobs == [-0.5]
