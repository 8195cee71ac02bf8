"""Fetching an http(s) image URL under the media policy: the host of the URL and of every redirect must be in
--allowed-media-domains; the address actually connected to (checked after connecting, so a DNS answer that
changes between a check and the connection cannot slip through) must not be private, loopback, link-local or
otherwise internal unless --allow-private-media-addresses; the whole fetch has --media-fetch-timeout seconds and
the body at most --max-image-bytes."""
from __future__ import annotations

import functools
import http.client
import ipaddress
import time
import urllib.parse
import urllib.request

from kestrel.errors import InvalidRequest

CHUNK = 64 * 1024


def _check_host(url: str, cfg, param: str, what: str) -> None:
    parts = urllib.parse.urlparse(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidRequest(f"{what} uses the scheme {parts.scheme!r}; image URLs are http(s)", param=param)
    host = parts.hostname or ""
    if host not in (cfg.allowed_media_domains or []):
        raise InvalidRequest(f"{what} on {host!r} is not allowed (--allowed-media-domains)", param=param)


def _check_address(address: str, cfg, param: str) -> None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global and not cfg.allow_private_media_addresses:
        raise InvalidRequest(f"image URL resolves to the non-public address {ip}; refused "
                             f"(--allow-private-media-addresses)", param=param)


def _checked(base: type, cfg, param: str):
    class Checked(base):
        def connect(self):
            super().connect()
            try:
                _check_address(self.sock.getpeername()[0], cfg, param)
            except InvalidRequest:
                self.close()
                raise
    return Checked


class _Redirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, cfg, param: str):
        self.cfg, self.param = cfg, param

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.cfg, self.param, "the image URL redirects to a URL that")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, cfg, param):
        super().__init__()
        self.cfg, self.param = cfg, param

    def http_open(self, req):
        return self.do_open(_checked(http.client.HTTPConnection, self.cfg, self.param), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, cfg, param):
        super().__init__()
        self.cfg, self.param = cfg, param

    def https_open(self, req):
        return self.do_open(functools.partial(_checked(http.client.HTTPSConnection, self.cfg, self.param),
                                              context=self._context), req)


def fetch_image(url: str, cfg, param: str, kind: str = "image") -> bytes:
    """The body of an http(s) URL of an image (or, `kind` "video", a video: the same limits)."""
    _check_host(url, cfg, param, f"an {kind} URL" if kind == "image" else f"a {kind} URL")
    budget = cfg.media_fetch_timeout
    deadline = time.monotonic() + budget
    opener = urllib.request.build_opener(_HTTP(cfg, param), _HTTPS(cfg, param), _Redirects(cfg, param))
    try:
        with opener.open(url, timeout=budget) as r:
            length = r.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > cfg.max_image_bytes:
                raise InvalidRequest(f"{kind} of {length} bytes exceeds the limit of {cfg.max_image_bytes}",
                                     param=param)
            body = bytearray()
            while len(body) <= cfg.max_image_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InvalidRequest(f"the {kind} did not arrive within {budget:g} s (--media-fetch-timeout)",
                                         param=param)
                r.fp.raw._sock.settimeout(left)  # no single read waits past the fetch's deadline
                chunk = r.read1(CHUNK)
                if not chunk:
                    break
                body += chunk
            return bytes(body)
    except InvalidRequest:
        raise
    except TimeoutError as e:
        raise InvalidRequest(f"the {kind} did not arrive within {budget:g} s (--media-fetch-timeout)",
                             param=param) from e
    except Exception as e:  # unreachable host, HTTP error: the caller's URL
        raise InvalidRequest(f"cannot fetch the {kind}: {e}", param=param) from e
