#!/usr/bin/env python3
"""A minimal P/D proxy for two vLLM OpenAI servers using a KV connector (stdlib only).

POST /v1/completions is sent first to the prefill server with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the ``kv_transfer_params`` of its
response are passed, unchanged, to the decode server with the original request, whose
response is returned. The client's ``Authorization`` header goes to both servers. A
request with prompt log-probs goes to the decode alone (vLLM reads no KV for it), and
one whose first token is a stop token is computed by the decode (no KV is offered).

Refused with 400 before any server sees them: ``"stream": true`` (not supported), a
batch of prompts (the prefill returns the first prompt's params only: send one prompt
per request), a body that is not a JSON object. A backend's error keeps its status, and
its message says which server failed (``prefill: ...``, ``decode: ...``).

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 16 << 20  # a request body (prompts as token ids included)


class Refused(Exception):
    """A request this proxy cannot serve: answered with ``status`` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def post(url: str, body: dict[str, Any], headers: dict[str, str],
         timeout_s: float = 300) -> dict[str, Any]:  # fmt: skip
    """POST ``body`` as JSON to ``url``; the decoded JSON response."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def check(body: object) -> dict[str, Any]:
    """``body`` if this proxy can serve it; :class:`Refused` (400) naming why otherwise."""
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise Refused(400, 'streaming is not supported by this proxy: send "stream": false')
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        raise Refused(400, "one prompt per request: the prefill returns the KV params of "
                           "the first prompt only")  # fmt: skip
    return body


def disaggregate(prefill: str, decode: str, body: dict[str, Any],
                 headers: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """One completion: prefill (1 token, keeps the KV), then decode (reads it)."""
    # the prefill makes one token: min_tokens above it, or stream_options without a
    # stream, are refused by vLLM
    base = {k: v for k, v in body.items() if k not in ("stream_options", "kv_transfer_params")}
    base["stream"] = False
    if body.get("prompt_logprobs") or (body.get("echo") and body.get("logprobs") is not None):
        # vLLM computes prompt log-probs on the decode, reading no KV: a prefill's hold
        # would only be pinned until its lease ends
        return _call("decode", f"{decode}/v1/completions", base, headers)
    # one token, one sequence (vLLM copies the params into each of n children: n holds,
    # one read); min_tokens above it is refused by vLLM
    pre = {k: v for k, v in base.items() if k != "min_tokens"}
    pre.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    out = _call("prefill", f"{prefill}/v1/completions", pre, headers)
    params = out.get("kv_transfer_params")
    if not params:
        choices = out.get("choices") or [{}]
        if isinstance(choices[0], dict) and choices[0].get("finish_reason") == "stop":
            # the first token was a stop token: vLLM offers no KV; the decode computes
            return _call("decode", f"{decode}/v1/completions", base, headers)
        raise Refused(502, "prefill: returned no kv_transfer_params (is its connector set?)")
    return _call("decode", f"{decode}/v1/completions",
                 {**base, "kv_transfer_params": params}, headers)  # fmt: skip


def _call(side: str, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """:func:`post`, a failure raised as :class:`Refused` naming ``side``."""
    try:
        return post(url, body, headers)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            err = json.loads(text).get("error", text)
            text = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            pass
        raise Refused(e.code, f"{side}: {text}") from None
    except (OSError, ValueError) as e:  # refused, timed out, not JSON
        raise Refused(502, f"{side}: {type(e).__name__}: {e}") from None


def make_handler(prefill: str, decode: str,
                 client_timeout_s: float = 30.0) -> type[BaseHTTPRequestHandler]:  # fmt: skip
    class Handler(BaseHTTPRequestHandler):
        timeout = client_timeout_s  # a client that stalls mid-request is dropped

        def _reply(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client went away: nobody to answer

        def _error(self, code: int, message: str) -> None:
            self._reply(code, {"error": {"message": message, "code": code}})

        def _body(self) -> object:
            length = self.headers.get("Content-Length")
            if length is None:
                raise Refused(411, "Content-Length is required")
            if not length.isdecimal():
                raise Refused(400, f"bad Content-Length {length[:40]!r}")
            if int(length) > MAX_BODY_BYTES:
                raise Refused(413, f"a body of {length} bytes is over {MAX_BODY_BYTES}")
            try:
                data = self.rfile.read(int(length))
            except TimeoutError:
                raise Refused(408, "the request body did not arrive in time") from None
            if len(data) < int(length):
                raise Refused(400, "the request body ended early")
            try:
                return json.loads(data)
            except ValueError:
                raise Refused(400, "the request body is not JSON") from None

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._error(404, f"no route {self.path}")
                return
            auth = self.headers.get("Authorization")
            headers = {"Authorization": auth} if auth else {}
            try:
                self._reply(200, disaggregate(prefill, decode, check(self._body()), headers))
            except Refused as e:
                self._error(e.status, str(e))
            except Exception as e:  # the proxy stays up for the next request
                self._error(500, f"proxy: {type(e).__name__}: {e}")

        def log_message(self, fmt: str, *args: Any) -> None:
            return None

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--prefill", required=True, help="prefill server base URL")
    ap.add_argument("--decode", required=True, help="decode server base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    server = ThreadingHTTPServer((a.host, a.port), make_handler(a.prefill, a.decode))
    print(f"proxy on http://{a.host}:{a.port} -> P {a.prefill}, D {a.decode}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
