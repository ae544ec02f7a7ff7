"""The probe server of charrun --serve and --livekit, and the readiness behind it: GET /healthz
(200 while the process is alive), /readyz (200 with {"state": "ready"} only when the engine is
loaded, its graphs captured and a session can start; 503 with the state otherwise) and /metrics
(the worker's Prometheus metrics, the same object as the page's /metrics), on --health-port.
Every request must name a host the server answers to (runtime/access.py: IP addresses,
localhost and --allow-host), so that no web page can read them by DNS rebinding; monitoring
that scrapes by address reads them as before.

The server is the standard library's ThreadingHTTPServer on a thread of its own, not an aiohttp
app: it must answer from before the engine loads (the load holds the main thread, before any
event loop exists) until the process exits, under whichever event loop the mode then runs
(aiohttp's for the page, LiveKit's for a fleet worker), and while that loop is busy. Three
read-only GET routes need nothing more. Each connection holds a thread while it is open,
so a connection that says nothing for IDLE_S is closed, and past MAX_CONNECTIONS at once a
new one is closed as it is accepted: no number of idle connections to the port holds the
process's threads or files (its probers, a kubelet and a scraper, need a few)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .access import Access

# What /readyz says, in the order a worker meets them. Only "ready" answers 200.
STATES = ("loading", "ready", "busy", "draining", "failed")
POLL_S = 0.1  # how often the probe thread looks for its stop
HEALTH_PORT = 8081  # --health-port's default
RANKS_DOWN = "a TP rank stopped: its ranks are being started afresh"
IDLE_S = 5.0  # a probe connection that sends nothing for this long is closed
MAX_CONNECTIONS = 64  # probe connections served at once; more are closed as they come


class ProbeError(RuntimeError):
    pass


class Readiness:
    """The worker's state for /readyz, set as charrun starts and stops (any thread): loading
    (the engine loads, warms up and captures its graphs, the page or the LiveKit registration
    starts, or a TP engine's ranks restart), ready, draining (SIGTERM: it stays so), failed
    (the engine could not load, or a TP engine's ranks could not restart). While ready,
    `busy()` (given to ready()) says whether a session is in progress: one session per
    worker, so a worker in a session reads busy."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self._phase, self._detail, self._since = "loading", "starting", clock()
        self._busy: Callable[[], bool] = lambda: False
        self._healthy: Callable[[], bool] = lambda: True
        self.engine: str | None = None  # the engine's target, once it is read

    def _set(self, phase: str, detail: str) -> None:
        with self._lock:
            if self._phase == "draining" and phase != "draining":
                return  # a stopping worker takes no session again
            if phase != self._phase:
                self._since = self._clock()
            self._phase, self._detail = phase, detail

    def loading(self, detail: str) -> None:
        self._set("loading", detail)

    def ready(self, busy: Callable[[], bool] | None = None,
              healthy: Callable[[], bool] | None = None) -> None:
        """Ready: `busy()` says whether the worker takes no more sessions (every lane has
        one: `--sessions N`, one by default); `healthy()` (a TP worker's
        `alive`) whether its rank processes all run, read at every report, so a rank that
        dies turns the worker not-ready before any offer can reach it."""
        if busy is not None:
            self._busy = busy
        if healthy is not None:
            self._healthy = healthy
        self._set("ready", "")

    def draining(self, detail: str) -> None:
        self._set("draining", detail)

    def failed(self, reason: str) -> None:
        self._set("failed", reason)

    def _now(self) -> tuple[str, str, float]:
        """(state, detail, since): a ready worker whose ranks stopped reads loading (they are
        started afresh), one in a session busy."""
        with self._lock:
            phase, detail, since = self._phase, self._detail, self._since
        if phase == "ready" and not self._healthy():
            return "loading", RANKS_DOWN, since
        if phase == "ready" and self._busy():
            return "busy", "every session this worker serves is in progress", since
        return phase, detail, since

    @property
    def state(self) -> str:
        return self._now()[0]

    def report(self) -> tuple[int, dict]:
        """/readyz's status and JSON body."""
        state, detail, since = self._now()
        body = {"state": state, "for_s": round(self._clock() - since, 3), "engine": self.engine}
        if detail:
            body["detail"] = detail
        return (200 if state == "ready" else 503), body


class _Handler(BaseHTTPRequestHandler):
    """The routes; `probes` is set on a subclass made for each ProbeServer."""

    probes: "ProbeServer"
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        path = urlsplit(self.path).path
        refused = self.probes.access.host_refusal(self.headers.get("Host"))
        if refused is not None:
            self._send(403, "application/json", json.dumps({"error": refused}))
        elif path == "/healthz":
            self._send(200, "application/json", json.dumps(
                {"alive": True, "uptime_s": round(time.monotonic() - self.probes.t0, 3)}))
        elif path == "/readyz":
            status, body = self.probes.readiness.report()
            self._send(status, "application/json", json.dumps(body))
        elif path == "/metrics":
            metrics = self.probes.metrics
            if metrics is None:
                self._send(503, "text/plain", "loading: no metrics before the engine is read\n")
            else:
                self._send(200, "text/plain; version=0.0.4", metrics.exposition())
        else:
            self._send(404, "application/json", json.dumps(
                {"error": f"no such probe {path}: GET /healthz, /readyz or /metrics"}))

    def _refuse(self):
        """Any other method: 403 for a host it does not serve, else 405; JSON either way."""
        refused = self.probes.access.host_refusal(self.headers.get("Host"))
        self.close_connection = True  # its body is not read: the connection ends with it
        self._send(403 if refused else 405, "application/json", json.dumps(
            {"error": refused or "the probe server answers GET only: /healthz, /readyz, "
                                 "/metrics"}))

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815 - http.server's names

    def _send(self, status: int, ctype: str, body: str | bytes) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass  # probes come every few seconds; the log is for what happens to sessions


class _ProbeHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer serving at most `max_connections` connections at once: one past
    them is closed as it is accepted (no thread, no file held)."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    request_queue_size = MAX_CONNECTIONS  # listen()'s backlog (the standard library's: 5)

    def server_activate(self):
        self.slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started to release it
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        """A connection the client broke (reset, or too slow to take its answer) is its
        affair: nothing printed; anything else is printed as the standard library does."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class ProbeServer:
    """The probe routes on host:port, served from a thread of its own from start() to stop().
    `metrics` (runtime/metrics.py's Metrics) may be given once the engine is read."""

    def __init__(self, readiness: Readiness, host: str, port: int, metrics=None,
                 access: Access = Access(), idle_s: float = IDLE_S,
                 max_connections: int = MAX_CONNECTIONS):
        self.readiness, self.host, self.port, self.metrics = readiness, host, port, metrics
        self.access = access  # the host names it answers to (runtime/access.py)
        self.idle_s, self.max_connections = idle_s, max_connections
        self.t0 = time.monotonic()
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> "ProbeServer":
        """Listen and serve; a port that cannot be had is one ProbeError line."""
        handler = type("ProbeHandler", (_Handler,), {"probes": self, "timeout": self.idle_s})
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_class = type("ProbeHTTPServer", (_ProbeHTTPServer,),
                            {"address_family": family,
                             "max_connections": self.max_connections})
        try:
            self.httpd = server_class((self.host, self.port), handler)
        except OSError as e:
            raise ProbeError(f"--health-port {self.port}: cannot listen on {self.host}:"
                             f"{self.port} ({e.strerror or e}); choose another port with "
                             "--health-port or stop what uses it") from None
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(POLL_S,),
                                       name="probes", daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
