"""Issue 33: image URLs under the media policy at every hop. Before, an allowed host that redirected to
127.0.0.1 had that address fetched (server-side request forgery), and a host dripping one byte at a time held
a render worker for 200 s."""
from __future__ import annotations

import io
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from kestrel.config import MultiModalConfig
from kestrel.errors import InvalidRequest
from kestrel.frontend.media import load_image_url

PNG = io.BytesIO()
Image.new("RGB", (8, 6), "blue").save(PNG, "PNG")
PNG = PNG.getvalue()


class Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        Handler.hits.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/img.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/to-loopback":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{port}/secret.png")
            self.end_headers()
        elif self.path == "/to-self":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/img.png")
            self.end_headers()
        elif self.path == "/drip":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass
        elif self.path == "/huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()


@pytest.fixture(scope="module")
def host():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://localhost:{srv.server_address[1]}"
    srv.shutdown()


ALLOWED = MultiModalConfig(allowed_media_domains=["localhost"], allow_private_media_addresses=True,
                           media_fetch_timeout=1.0, max_image_bytes=100_000)


def test_an_allowed_url_loads(host):
    assert load_image_url(host + "/img.png", ALLOWED, "p").size == (8, 6)
    assert load_image_url(host + "/to-self", ALLOWED, "p").size == (8, 6)  # a redirect within the policy


def test_a_redirect_to_a_disallowed_host_is_refused(host):
    Handler.hits.clear()
    with pytest.raises(InvalidRequest, match="redirects to a URL that on '127.0.0.1' is not allowed") as e:
        load_image_url(host + "/to-loopback", ALLOWED, "messages[0].content[0].image_url")
    assert e.value.param == "messages[0].content[0].image_url"
    assert Handler.hits == ["/to-loopback"]  # the internal URL was never requested


def test_a_loopback_address_is_refused_unless_allowed(host):
    Handler.hits.clear()
    cfg = replace(ALLOWED, allow_private_media_addresses=False)
    with pytest.raises(InvalidRequest, match="non-public address 127.0.0.1.*--allow-private-media-addresses"):
        load_image_url(host + "/img.png", cfg, "p")
    assert Handler.hits == []  # refused on connecting, before the request was sent


def test_a_slow_drip_is_cut_at_the_fetch_budget(host):
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"did not arrive within 1 s \(--media-fetch-timeout\)"):
        load_image_url(host + "/drip", ALLOWED, "p")
    assert time.monotonic() - t0 < 2.0


def test_a_body_over_the_size_cap_is_refused_before_reading(host):
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match="1000000000 bytes exceeds the limit of 100000"):
        load_image_url(host + "/huge", ALLOWED, "p")
    assert time.monotonic() - t0 < 1.0
