"""A real `kestrel serve` in a subprocess (engine cores in their own processes) on 127.0.0.1 and a free port."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.tiny import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, headers=None, raw: bytes | None = None, timeout: float = 30):
    """(status, parsed JSON or text) without raising on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Server:
    def __init__(self, model: Path, log: Path, extra: list[str] = (), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [sys.executable, "-m", "kestrel.cli", "serve", str(model), "--port", str(self.port),
               "--num-kv-blocks", "96", "--max-model-len", "512", "--cpu-threads", "1", *extra]
        e = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e, cwd=ROOT)

    def wait_ready(self, timeout: float = 180) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                if http("GET", self.url + "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready:\n{self.log_path.read_text()[-3000:]}")

    def health(self):
        return http("GET", self.url + "/health")

    def engine_pids(self) -> list[int]:
        """The live engine-core pids, from their "engine core N ready (pid P)" log lines (/health shows none)."""
        self.log.flush()
        pids: dict[int, int] = {}
        for m in re.finditer(r"engine core (\d+) ready \(pid (\d+)\)", self.log_path.read_text()):
            pids[int(m.group(1))] = int(m.group(2))
        return [pids[i] for i in sorted(pids)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="session")
def server_model(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("server_model"), tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def server(server_model, tmp_path_factory):
    """The shared server of the API, bad-input and benchmark tests (started once)."""
    s = Server(server_model, tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield s
    s.stop()


NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="session")
def spec_server(server_model, tmp_path_factory):
    """The shared server's twin with n-gram speculation on (the spec-decode tests, and the hostile cases run with
    speculation on as well as off)."""
    s = Server(server_model, tmp_path_factory.mktemp("spec_logs") / "server.log",
               ["--speculative-config", json.dumps(NGRAM_SPEC)]).wait_ready()
    yield s
    s.stop()


@pytest.fixture(params=["plain", "ngram"])
def any_server(request):
    """The shared server, then its twin with n-gram speculation: a test that takes this runs against both."""
    return request.getfixturevalue("server" if request.param == "plain" else "spec_server")


@pytest.fixture(scope="session")
def offline_llm(server_model):
    """The same checkpoint offline, for output equality."""
    from kestrel import LLM

    return LLM(str(server_model), progress=False, num_kv_blocks=96, max_model_len=512)
