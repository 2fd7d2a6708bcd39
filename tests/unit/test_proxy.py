"""``examples/vllm/proxy.py`` against two fake vLLM servers (threads on 127.0.0.1 that
record each request): what it forwards, what it refuses, and what a client gets back."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

PROXY = Path(__file__).resolve().parents[2] / "examples" / "vllm" / "proxy.py"
_spec = importlib.util.spec_from_file_location("kvxfer_example_proxy", PROXY)
assert _spec is not None and _spec.loader is not None
proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proxy)

pytestmark = pytest.mark.timeout(60)


class Backend:
    """A fake vLLM completions server; ``fail`` makes it answer that status."""

    def __init__(self, role: str) -> None:
        self.role, self.seen, self.fail, self.stopped = role, [], 0, False
        backend = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                backend.seen.append({"auth": self.headers.get("Authorization"), "body": body})
                if backend.fail:
                    out: dict[str, Any] = {"error": {"message": "boom", "code": backend.fail}}
                    code = backend.fail
                elif backend.role == "prefill" and backend.stopped:
                    out, code = {"choices": [{"text": "", "finish_reason": "stop"}]}, 200
                elif backend.role == "prefill":
                    out, code = {"choices": [{"text": "x"}], "kv_transfer_params": {"k": 1}}, 200
                else:
                    out, code = {"choices": [{"text": "decoded"}]}, 200
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def pd() -> Iterator[tuple[Backend, Backend, str]]:
    p, d = Backend("prefill"), Backend("decode")
    handler = proxy.make_handler(p.url, d.url, client_timeout_s=0.5)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    yield p, d, f"http://127.0.0.1:{srv.server_address[1]}"
    for s in (srv, p.server, d.server):
        s.shutdown()
        s.server_close()


def ask(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data,
                                 {"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_request_goes_to_the_prefill_then_the_decode_with_its_params(pd: Any) -> None:
    p, d, url = pd
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "min_tokens": 4,
            "stream": False, "stream_options": {"include_usage": True}}  # fmt: skip
    code, out = ask(url, body, {"Authorization": "Bearer sk-x"})
    assert (code, out) == (200, {"choices": [{"text": "decoded"}]})
    (pre,), (dec,) = p.seen, d.seen
    assert pre["body"]["max_tokens"] == 1 and pre["body"]["kv_transfer_params"] == {
        "do_remote_decode": True
    }
    # vLLM refuses min_tokens over max_tokens, and stream_options without stream
    assert "min_tokens" not in pre["body"] and "stream_options" not in pre["body"]
    assert dec["body"]["min_tokens"] == 4 and "stream_options" not in dec["body"]
    assert dec["body"]["kv_transfer_params"] == {"k": 1} and dec["body"]["max_tokens"] == 8
    assert pre["auth"] == dec["auth"] == "Bearer sk-x"  # servers run with --api-key


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"prompt": [1, 2], "stream": True}, 400, "streaming is not supported"),
        ({"prompt": [[1, 2], [3, 4]]}, 400, "one prompt per request"),
        ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
        ([1, 2], 400, "the request body must be a JSON object"),
        (b"{oops", 400, "the request body is not JSON"),
    ],
)
def test_requests_it_cannot_serve_are_refused_before_any_backend(
    pd: Any, body: object, code: int, message: str
) -> None:
    p, d, url = pd
    got, out = ask(url, body)
    assert got == code and message in out["error"]["message"], out
    assert p.seen == d.seen == []


def test_a_backend_error_keeps_its_status_and_says_which_side(pd: Any) -> None:
    p, d, url = pd
    p.fail = 500
    code, out = ask(url, {"prompt": [1, 2]})
    assert code == 500 and out["error"]["message"].startswith("prefill: "), out
    assert "boom" in out["error"]["message"] and d.seen == []
    p.fail, d.fail = 0, 400
    code, out = ask(url, {"prompt": [1, 2]})
    assert code == 400 and out["error"]["message"].startswith("decode: "), out


def _raw(url: str, head: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head)
        t0 = time.monotonic()
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        assert time.monotonic() - t0 < 3, "the proxy held a stalled client"
        return out


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", b"411"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", b"400"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n",
         b"413"),
        # a body shorter than its Content-Length: the client stalls; answered, not held
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}", b"408"),
    ],
)  # fmt: skip
def test_bad_lengths_and_stalled_clients_get_an_answer(pd: Any, head: bytes, status: bytes) -> None:
    p, d, url = pd
    out = _raw(url, head)
    assert out.split(b"\r\n", 1)[0].split(b" ")[1] == status, out[:200]
    assert p.seen == d.seen == []


def test_parallel_sampling_prefills_once(pd: Any) -> None:
    # vLLM copies a request's params into each of its n children: the prefill made n
    # holds of which one at most is read, the others pinned until their lease ended
    p, d, url = pd
    assert ask(url, {"prompt": [1, 2], "n": 3})[0] == 200
    assert p.seen[0]["body"]["n"] == 1 and d.seen[0]["body"]["n"] == 3


@pytest.mark.parametrize(
    "extra", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}], ids=["prompt_lp", "echo"]
)
def test_requests_that_read_no_kv_go_straight_to_the_decode(pd: Any, extra: dict[str, Any]) -> None:
    # prompt log-probs make vLLM's decode skip the loaded prefix: a prefill's hold would
    # only be pinned until its lease ended
    p, d, url = pd
    assert ask(url, {"prompt": [1, 2], **extra})[0] == 200
    assert p.seen == [] and "kv_transfer_params" not in d.seen[0]["body"]


def test_a_prefill_that_stopped_at_its_first_token_leaves_the_decode_to_compute(pd: Any) -> None:
    # its first token was a stop token: vLLM offers no KV for a stopped request
    p, d, url = pd
    p.stopped = True
    assert ask(url, {"prompt": [1, 2]})[0] == 200
    assert "kv_transfer_params" not in d.seen[0]["body"]
