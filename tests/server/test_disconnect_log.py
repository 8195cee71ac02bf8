"""Issue 36: a client that leaves a non-streamed request is one log line (its request aborted and why), never
uvicorn's 74-line CancelledError traceback; the engine frees the request's blocks and keeps serving."""
from __future__ import annotations

import json
import re
import socket
import time

from conftest import Server, http


def _post_and_leave(port: int, path: str, body: dict, after_s: float) -> None:
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        time.sleep(after_s)


def test_non_streamed_disconnect_is_one_log_line(server_model, tmp_path):
    s = Server(server_model, tmp_path / "server.log", ["--max-model-len", "4096", "--num-kv-blocks", "300"])
    try:
        s.wait_ready()
        _post_and_leave(s.port, "/v1/completions",
                        {"model": "llama", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True}, 1.5)
        _post_and_leave(s.port, "/v1/chat/completions",
                        {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                         "ignore_eos": True}, 1.5)
        deadline = time.monotonic() + 30
        while (tmp_path / "server.log").read_text().count("aborted") < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1.5)  # the handler's own exit after the abort
        status, body = http("POST", s.url + "/v1/completions", {"model": "llama", "prompt": "hi", "max_tokens": 2})
        assert status == 200, body
    finally:
        s.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-4000:]
    started = re.findall(r"request (\S+): \d+ prompt tokens", log)
    assert len(started) == 3, log[-4000:]
    for rid in started[:2]:  # after its arrival line, each left request has exactly one line: its abort
        lines = [line for line in log.splitlines() if rid in line]
        assert len(lines) == 2 and lines[1].endswith(f"request {rid} aborted: its caller went away (client "
                                                     f"disconnected)"), lines
