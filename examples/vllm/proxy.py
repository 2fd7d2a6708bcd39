#!/usr/bin/env python3
"""A minimal P/D proxy for two vLLM OpenAI servers using a KV connector (stdlib only).

POST /v1/completions is sent first to the prefill server with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the ``kv_transfer_params`` of its
response are passed, unchanged, to the decode server with the original request, whose
response is returned. Streaming is not supported (``stream`` is forced off).

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


def post(url: str, body: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url``; the decoded JSON response."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def disaggregate(prefill: str, decode: str, body: dict[str, Any]) -> dict[str, Any]:
    """One completion: prefill (1 token, keeps the KV), then decode (reads it)."""
    pre = {**body, "max_tokens": 1, "stream": False,
           "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    params = post(f"{prefill}/v1/completions", pre).get("kv_transfer_params")
    if not params:
        raise RuntimeError("the prefill server returned no kv_transfer_params (connector?)")
    return post(f"{decode}/v1/completions", {**body, "stream": False, "kv_transfer_params": params})


def make_handler(prefill: str, decode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._reply(404, {"error": f"no route {self.path}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._reply(200, disaggregate(prefill, decode, body))
            except urllib.error.HTTPError as e:
                self._reply(e.code, {"error": e.read().decode(errors="replace")})
            except Exception as e:  # the proxy stays up for the next request
                self._reply(502, {"error": f"{type(e).__name__}: {e}"})

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
