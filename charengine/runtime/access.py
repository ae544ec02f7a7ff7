"""Who may use charrun's HTTP ports (the page's and the probes'): the host names they answer
to, the web pages whose requests may change state, and how many uploads may be in flight.

A web page the user visits elsewhere can send requests to a server on the user's own machine:
a cross-site POST needs no permission when its body is a "simple" type (text/plain), and a
page whose name an attacker re-points at 127.0.0.1 (DNS rebinding) is, to the browser, the
server's own origin. So:

- Host: every request names a host the server answers to: an IP address (a rebinding attack
  needs a name), `localhost` (and names under `.localhost`, which browsers keep on loopback),
  or a name given with --allow-host (`*`: any, for a server behind a proxy that checks it).
- Origin: a request that changes state (every POST) from a browser carries Origin; it must be
  the origin the page was served from (`http://` and the request's Host) or one given with
  --allow-origin (a deployment's own front end, e.g. https://chars.example.com). "null" (a
  sandboxed frame, a file) is refused. A request without Origin comes from no web page (a
  browser always sends it on POST): a script, a bot's client, curl; it passes.
- JSON as JSON: a POST must say Content-Type: application/json, which a cross-site page can
  send only after a CORS preflight that this server never grants.
- Session ids: a control request or an events channel acts on the session whose id (an
  unguessable token) it names, compared in constant time as UTF-8 bytes, so that an id of any
  characters is just one that names no session.
- Uploads in flight: at most MAX_UPLOADS offers' bodies are read at once, holding at most
  MAX_UPLOAD_BYTES_IN_FLIGHT between them (a body's declared length, or the largest one
  allowed where it declares none); past either the offer gets 503 with Retry-After before its
  body is read.
- Framing and guessing: every response says (PAGE_HEADERS) that no page may frame it (one
  could lay its own buttons over the page's Start and Stop, or ask for the microphone
  through it), that the browser is not to guess a type it was not given, that the page runs
  only its own script and style and talks only to its own server, and that its address is
  not passed on to sites it links to.
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from .formats import cut

LOCAL_NAMES = ("localhost",)
ANY_HOST = "*"
JSON_TYPE = "application/json"
MAX_UPLOADS = 4  # offer bodies read at once
MAX_UPLOAD_BYTES_IN_FLIGHT = 128 * 1024 * 1024  # their declared sizes together
UPLOAD_RETRY_AFTER_S = 2  # what a 503 for uploads in flight tells the client to wait
DEFAULT_PORTS = {"http": 80, "https": 443}
# what the page loads: its own script, style and fetches; images and sounds the user chose
# (blob: previews, data: uploads); the WebRTC stream is a MediaStream, outside these
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
               "img-src 'self' data: blob:; media-src 'self' blob:; connect-src 'self'; "
               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
PAGE_HEADERS = {"Content-Security-Policy": PAGE_POLICY, "X-Frame-Options": "DENY",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class AccessError(ValueError):
    """A flag's value that is not a host name or an origin (one line)."""


def _host_and_port(netloc: str) -> tuple[str, int | None] | None:
    """('name', port) of a Host header's value or an origin's netloc, the name lower-case
    without brackets or a trailing dot; None where it does not parse."""
    try:
        parts = urlsplit("//" + netloc)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name or parts.username is not None or parts.path or parts.query:
        return None
    return name.rstrip(".").lower(), port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin ('https://a.example:8443'), the port filled in
    where the scheme implies it; None for anything else ("null", a path, another scheme)."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or parts.path not in ("", "/") or parts.query \
            or parts.fragment:
        return None
    hp = _host_and_port(parts.netloc)
    if hp is None:
        return None
    return parts.scheme, hp[0], hp[1] if hp[1] is not None else DEFAULT_PORTS[parts.scheme]


@dataclass(frozen=True)
class Access:
    """The names the ports answer to beyond IP addresses and localhost (`allow_hosts`; `*`
    any) and the origins beyond the page's own whose requests may change state
    (`allow_origins`, e.g. "https://chars.example.com")."""

    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()

    def __post_init__(self):
        hosts = []
        for h in self.allow_hosts:
            hp = None if h == ANY_HOST else _host_and_port(h)
            if h != ANY_HOST and (hp is None or hp[1] is not None):
                raise AccessError(f"--allow-host {h!r}: give a host name (chars.example.com), "
                                  f"without scheme or port, or {ANY_HOST!r} for any")
            hosts.append(h if h == ANY_HOST else hp[0])
        origins = []
        for o in self.allow_origins:
            key = origin_key(o)
            if key is None:
                raise AccessError(f"--allow-origin {o!r}: give an origin, scheme and host "
                                  "(and port), e.g. https://chars.example.com")
            origins.append(key)
        object.__setattr__(self, "allow_hosts", tuple(hosts))
        object.__setattr__(self, "_origins", frozenset(origins))

    def host_refusal(self, host: str | None) -> str | None:
        """Why a request naming `host` (its Host header) is refused, or None."""
        hp = _host_and_port(host or "")
        if hp is None:
            return "the request names no host (or one that does not parse)"
        name = hp[0]
        if _is_ip(name) or name in LOCAL_NAMES or name.endswith(".localhost") \
                or ANY_HOST in self.allow_hosts or name in self.allow_hosts:
            return None
        return (f"this server does not answer to the name {name!r}: open it by its address "
                f"or as localhost, or start charrun with --allow-host {name}")

    def origin_refusal(self, origin: str | None, host: str | None) -> str | None:
        """Why a state-changing request from a page at `origin` (its Origin header; None:
        not from a web page) to the server named `host` is refused, or None."""
        if origin is None:
            return None
        key = origin_key(origin)
        if key is not None:
            served = _host_and_port(host or "")
            if served is not None and key == ("http", served[0], served[1] or 80):
                return None
            if key in self._origins:
                return None
        return (f"requests from the page at {cut(origin)!r} may not control this server: use its "
                "own page, or start charrun with --allow-origin for your front end")


def same_token(given: str, token: str) -> bool:
    """Whether `given` is the session id `token`, in constant time for ids of one length
    (secrets.compare_digest, on bytes: on strings it refuses non-ASCII ones with a
    TypeError)."""
    return secrets.compare_digest(given.encode("utf-8", "surrogatepass"),
                                  token.encode("utf-8", "surrogatepass"))


class UploadGate:
    """Offers whose bodies are being read: at most `max_count` at once, holding at most
    `max_bytes` by their declared lengths (an undeclared one counts as `largest`). For one
    event loop: admit() and release() are called from it alone."""

    def __init__(self, largest: int, max_count: int = MAX_UPLOADS,
                 max_bytes: int = MAX_UPLOAD_BYTES_IN_FLIGHT):
        self.largest, self.max_count, self.max_bytes = largest, max_count, max_bytes
        self.count = 0
        self.bytes = 0

    def admit(self, declared: int | None) -> int | None:
        """Room for a body of `declared` bytes (None: unknown): the bytes reserved, to give
        to release(); None where there is none."""
        size = self.largest if declared is None else min(declared, self.largest)
        if self.count + 1 > self.max_count or self.bytes + size > self.max_bytes:
            return None
        self.count += 1
        self.bytes += size
        return size

    def release(self, size: int) -> None:
        self.count -= 1
        self.bytes -= size
