"""The lab's HTTP server: the standard library's ``ThreadingHTTPServer``, a static page and four JSON endpoints.

=====================  ======  ==================================================
path                   method  answer
=====================  ======  ==================================================
``/``                  GET     the page (``static/index.html``)
``/static/<file>``     GET     the page's script and style (a fixed list)
``/api/config``        GET     each panel's fields (ranges, choices, defaults),
                               its "worked example" settings and its passage
``/api/<panel>``       POST    JSON fields in, the panel's numbers out
                               (``interference``, ``geometry``, ``spotlight``,
                               ``memory``; see :mod:`fastweights.lab.compute`)
=====================  ======  ==================================================

Bad input never reaches a traceback: a field out of range, NaN, an unknown rule or
panel, a malformed or oversized body, JSON nested deeper than Python's parser goes,
a number with more than ``MAX_DIGITS`` digits gets a 4xx with ``{"error": message}``
naming the field where there is one. Every answer closes its connection (one request
per connection, ``Connection: close``). The listen backlog holds a burst of
``BACKLOG`` connections; past ``MAX_ACTIVE`` requests in progress a new one is
answered 503 at once instead of queueing without bound. Each
request is bounded in size (``MAX_BODY`` bytes) and in time: a client that sends
its request slower than ``REQUEST_TIMEOUT`` seconds is answered 408 and dropped
(each connection has its own thread, so a slow one does not hold up the others),
and the fields' ranges bound the computing one request can ask for. Computations
run one at a time (the ops use the CPU's threads anyway).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Optional, Tuple

from . import compute
from .params import LabInputError, describe, parse

MAX_BODY = 64 * 1024
REQUEST_TIMEOUT = 5.0
MAX_DIGITS = 100  # longer integers are refused (Python refuses to convert past 4300 digits anyway)
BACKLOG = 1024  # connections the OS queues before accept(): a burst of page loads fits
MAX_ACTIVE = 256  # requests in progress (one thread each) before new ones are answered 503
STATIC = {"index.html": "text/html; charset=utf-8", "lab.js": "text/javascript; charset=utf-8",
          "lab.css": "text/css; charset=utf-8"}


def _reject_constant(name: str):
    raise LabInputError(f"the request body holds {name}, which is not a number JSON allows")


class HugeNumber:
    """An integer literal of more than ``MAX_DIGITS`` digits, kept as text: the field check
    that meets it names the field ("`n` must be a number ..., got a 5000-digit number")."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"a {self.digits}-digit number"


def _parse_int(text: str):
    return HugeNumber(text) if len(text) > MAX_DIGITS else int(text)


def decode_body(raw: bytes):
    """Parse a request body as strict JSON (NaN and Infinity refused, huge integers kept as
    :class:`HugeNumber`, floats past the float range as ±inf: the field checks refuse both)."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LabInputError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise LabInputError("the request body nests arrays or objects too deeply to parse; the lab's fields "
                            "are numbers, strings and lists of number lists") from None


def config() -> dict:
    """What the page needs to build its controls."""
    return {name: {"fields": describe(fields), "example": example, "passage": compute.PASSAGES[name]}
            for name, (fields, _, example) in compute.PANELS.items()}


def answer(panel: str, body) -> dict:
    """The numbers of ``panel`` for the request ``body`` (a parsed JSON object)."""
    if panel not in compute.PANELS:
        raise KeyError(panel)
    fields, fn, _ = compute.PANELS[panel]
    return fn(parse(body, fields, panel))


class LabHandler(BaseHTTPRequestHandler):
    server_version = "fastweights-lab"
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive sockets to time out
    timeout = REQUEST_TIMEOUT + 1  # per-recv socket timeout; the watchdog below (sooner) answers 408
    compute_lock = threading.Lock()
    quiet = True

    def log_message(self, format, *args):  # the base class's name
        if not self.quiet:
            super().log_message(format, *args)

    # --- replies -----------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.close_connection = True  # one request per connection: closed right after this answer
        self.send_response(status)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":
            self.wfile.write(body)

    def send_error(self, code, message=None, explain=None):
        """Errors the base class raises itself (a malformed request line, an unsupported method): JSON too."""
        self.close_connection = True
        self.request_version = "HTTP/1.0"  # a garbled line parses as HTTP/0.9, which has no status line
        short = self.responses.get(code, ("error",))[0]
        self._json(code, {"error": f"{code} {message or short}"})

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload, allow_nan=False).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    # --- GET -----------------------------------------------------------------
    def do_GET(self):
        self._request_read()
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            path = "/static/index.html"
        if path.startswith("/static/") and path[len("/static/"):] in STATIC:
            name = path[len("/static/"):]
            data = resources.files("fastweights.lab").joinpath("static", name).read_bytes()
            return self._send(200, data, STATIC[name])
        if path == "/api/config":
            return self._json(200, config())
        self._error(404, f"no page or endpoint at {path!r}; the endpoints are /api/config and "
                         f"POST /api/{{{', '.join(compute.PANELS)}}}")

    do_HEAD = do_GET

    # --- POST ----------------------------------------------------------------
    def _read_body(self) -> Tuple[Optional[bytes], Optional[Tuple[int, str]]]:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            return None, (411, "send the body with a Content-Length (no chunked transfer)")
        if length is None:
            return None, (411, "a POST needs a Content-Length header")
        try:
            n = int(length)
        except ValueError:
            return None, (400, f"Content-Length must be an integer, got {length!r}")
        if n < 0:
            return None, (400, f"Content-Length must be >= 0, got {n}")
        if n > MAX_BODY:
            return None, (413, f"the request body is {n} bytes; the lab accepts at most {MAX_BODY}")
        chunks, got = [], 0
        try:
            while got < n:
                chunk = self.rfile.read1(n - got)
                if not chunk:
                    return None, (400, f"the body ended after {got} of {n} bytes")
                chunks.append(chunk)
                got += len(chunk)
        except (socket.timeout, TimeoutError):
            return None, (408, f"the request body did not arrive within {REQUEST_TIMEOUT:g} s")
        return b"".join(chunks), None

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        raw, problem = self._read_body()
        self._request_read()
        if problem:
            return self._error(*problem)
        panel = path[len("/api/"):] if path.startswith("/api/") else None
        if panel not in compute.PANELS:
            return self._error(404, f"no endpoint at {path!r}; POST to /api/{{{', '.join(compute.PANELS)}}}")
        try:
            body = decode_body(raw)
            with self.compute_lock:
                start = time.perf_counter()
                result = answer(panel, body)
                result["compute_ms"] = round(1e3 * (time.perf_counter() - start), 2)
        except LabInputError as e:
            return self._error(400, str(e))
        except Exception as e:  # a bug, not bad input: say so without a traceback on the page
            return self._error(500, f"{panel}: internal error ({type(e).__name__}: {e})")
        try:
            payload = json.dumps(result, allow_nan=False).encode()
        except ValueError as e:  # a NaN or Inf in an answer is a bug: say so, never drop the socket
            return self._error(500, f"{panel}: internal error (a non-finite number in the answer: {e})")
        self._send(200, payload, "application/json")

    # The whole request (line, headers, body) must arrive within REQUEST_TIMEOUT: the
    # socket timeout alone bounds each recv, not a client that drips a byte at a time.
    def handle_one_request(self):
        watchdog = threading.Timer(REQUEST_TIMEOUT, self._too_slow)
        watchdog.daemon = True
        self._watchdog = watchdog
        watchdog.start()
        try:
            super().handle_one_request()
        except (OSError, ValueError):  # the watchdog closed the socket under a read
            self.close_connection = True
        finally:
            watchdog.cancel()

    def _too_slow(self) -> None:
        body = json.dumps({"error": f"the request did not arrive within {REQUEST_TIMEOUT:g} s"}).encode()
        try:
            self.connection.sendall(b"HTTP/1.0 408 Request Timeout\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                                    + body)
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _request_read(self) -> None:
        """The request is in: stop the watchdog before computing and answering."""
        self._watchdog.cancel()


class LabServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = BACKLOG  # listen() backlog (the standard library's default is 5)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._active = threading.BoundedSemaphore(MAX_ACTIVE)

    def process_request(self, request, client_address):
        """One thread per request, at most ``MAX_ACTIVE`` at once; past that a 503, then close."""
        if not self._active.acquire(blocking=False):
            body = json.dumps({"error": f"the lab is busy ({MAX_ACTIVE} requests in progress); retry"}).encode()
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._active.release()


def make_server(host: str = "127.0.0.1", port: int = 0, quiet: bool = True) -> LabServer:
    """A server bound to ``host:port`` (port 0: a free one), not yet serving."""
    handler = type("Handler", (LabHandler,), {"quiet": quiet})
    return LabServer((host, port), handler)


def url_of(server: LabServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


def serve(host: str = "127.0.0.1", port: int = 8765, open_browser: bool = False, quiet: bool = True) -> None:
    """Serve the lab until interrupted; print the URL, open it in a browser only when asked."""
    server = make_server(host, port, quiet)
    url = url_of(server)
    print(f"fastweights lab: serving on {url}  (Ctrl-C to stop)", flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
