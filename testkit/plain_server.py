"""The least an OpenAI-compatible server offers, unlike vLLM and unlike our fake: chat
completions (and, optionally, /v1/models), no /health, no /metrics; and `serving`, which
runs any such small handler on a free port for a test."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator

from ocrvl_daemon.config.models import DEFAULT_MODEL


class _Handler(http.server.BaseHTTPRequestHandler):
    lists_models = True
    model = DEFAULT_MODEL
    finish_reason = "stop"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, code: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models" and self.lists_models:
            self._send(200, {"object": "list", "data": [{"id": self.model}]})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if request["model"] != self.model:  # as vLLM answers
            self._send(404, {"object": "error", "type": "NotFoundError", "code": 404,
                             "message": f"The model `{request['model']}` does not exist."})
            return
        text = f"plain server saw {request['messages'][0]['content'][1]['text']}"
        self._send(200, {"id": "1", "object": "chat.completion", "created": 0,
                         "model": request["model"], "usage": {"prompt_tokens": 1,
                         "completion_tokens": 1, "total_tokens": 2},
                         "choices": [{"index": 0, "finish_reason": self.finish_reason,
                                      "message": {"role": "assistant", "content": text}}]})


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free local port in a thread; yields http://127.0.0.1:PORT.
    Always shut down and joined."""
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


@contextlib.contextmanager
def plain_openai_server(*, lists_models: bool = True, model: str = DEFAULT_MODEL,
                        finish_reason: str = "stop") -> Iterator[str]:
    """Serve `model` on a free port; yields the OpenAI base URL (ending in /v1). Each answer
    is "plain server saw <the prompt>", ending with `finish_reason` ("length": cut off); a
    request for another model gets vLLM's 404."""
    handler = type("Handler", (_Handler,), {"lists_models": lists_models, "model": model,
                                            "finish_reason": finish_reason})
    with serving(handler) as url:
        yield url + "/v1"
