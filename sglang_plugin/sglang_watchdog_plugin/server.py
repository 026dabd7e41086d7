"""HTTP listener: GET /healthz, GET /debug/inflight, POST /admin/force_fail.

The contract is docs/plugin-api.md, including its "Project clarifications".
Handlers run on the listener's own threads and only read the Monitor's
published state; force-fail orders are handed to the scheduler thread.
"""

import hmac
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .orders import bad_request, unauthorized

logger = logging.getLogger("sglang_watchdog_plugin")

MAX_BODY_BYTES = 64 * 1024
# Reading the rest of an over-long body before closing keeps the client from
# seeing a connection reset instead of our answer; past this, just close.
_DRAIN_LIMIT_BYTES = 1024 * 1024
_ROOM_LIMIT = 2**64


class Listener:
    def __init__(self, monitor, config, port):
        handler = type("Handler", (_Handler,), {"monitor": monitor, "config": config})
        server_class = _Server6 if ":" in config.host else _Server
        self._server = server_class((config.host, port), handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"sglang-watchdog-plugin:{self.port}", daemon=True
        )
        self._thread.start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()


def start_listener(monitor, config):
    """Starts the rank's listener, or logs why not and returns None."""
    ident = monitor.identity
    port = config.port_for(ident.index)
    try:
        listener = Listener(monitor, config, port)
    except OSError as e:
        logger.error(
            "sglang-watchdog plugin cannot listen on %s port %d (%s); it stays off for dp_rank=%d pp_rank=%d",
            config.host, port, e, ident.dp_rank, ident.pp_rank,
        )
        return None
    logger.info(
        "sglang-watchdog plugin listening on %s port %d (dp_rank=%d pp_rank=%d tp_rank=%d backend=%s token=%s)",
        listener.host, listener.port, ident.dp_rank, ident.pp_rank, ident.tp_rank, ident.backend,
        "set" if config.token is not None else "not set",
    )
    if not config.admin_allowed:
        logger.warning(
            "sglang-watchdog plugin refuses /admin/* on %s: set a usable SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE "
            "(a token is required off loopback); /debug/inflight and /healthz stay open",
            config.host,
        )
    return listener


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # Mostly clients going away mid-answer: not worth a traceback on stderr.
        logger.debug("sglang-watchdog plugin: error while serving %s", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    monitor = None
    config = None
    server_version = "sglang-watchdog-plugin"
    # A stalled client must not hold a listener thread forever.
    timeout = 10

    def do_GET(self):
        path = urlsplit(self.path).path
        if path == "/healthz":
            self._send(200, b"ok", "text/plain; charset=utf-8")
        elif path == "/debug/inflight":
            self._send_json(200, self.monitor.listing())
        elif path == "/admin/force_fail":
            self._send_json(405, {"error": "use POST for /admin/force_fail"})
        else:
            self._send_json(404, {"error": f"no endpoint at {path}"})

    def do_POST(self):
        path = urlsplit(self.path).path
        if path != "/admin/force_fail":
            self._send_json(404, {"error": f"no endpoint at {path}"})
            self._drain(self._content_length() or 0)
            return
        length = self._content_length()
        outcome = self._refusal() or self._body_problem(length)
        if outcome is not None:
            self._send_json(outcome.status, outcome.body)
            self._drain(length or 0)
            return
        outcome = self._force_fail(self.rfile.read(length))
        self._send_json(outcome.status, outcome.body)

    def _refusal(self):
        config = self.config
        if not config.admin_allowed:
            return unauthorized("/admin/* is disabled on this listener: it needs a usable token off loopback")
        if config.token is None:
            return None
        scheme, _, credentials = self.headers.get("Authorization", "").partition(" ")
        try:
            presented = credentials.strip().encode("latin-1")
        except UnicodeEncodeError:
            presented = b""
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented, config.token):
            return unauthorized("missing or wrong bearer token")
        return None

    def _body_problem(self, length):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            return bad_request("chunked bodies are not supported; send Content-Length")
        if length is None:
            return bad_request("missing or invalid Content-Length")
        if length > MAX_BODY_BYTES:
            return bad_request(f"body larger than {MAX_BODY_BYTES} bytes")
        return None

    def _force_fail(self, body):
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return bad_request("body is not valid JSON")
        if not isinstance(payload, dict):
            return bad_request("body must be a JSON object")
        rid = payload.get("rid")
        if not isinstance(rid, str) or not rid:
            return bad_request("rid must be a non-empty string")
        room = payload.get("bootstrap_room")
        if "bootstrap_room" in payload and not (_is_int(room) and 0 <= room < _ROOM_LIMIT):
            return bad_request("bootstrap_room must be an integer in [0, 2^64)")
        dry_run = payload.get("dry_run", False)
        if not isinstance(dry_run, bool):
            return bad_request("dry_run must be a boolean")
        reason = payload.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            reason = None
        return self.monitor.force_fail(rid, room, reason, dry_run)

    def _content_length(self):
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return None
        return length if length >= 0 else None

    def _drain(self, length):
        if length > _DRAIN_LIMIT_BYTES:
            self.close_connection = True
            return
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 65536))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            self.close_connection = True

    def _send_json(self, status, payload):
        self._send(status, json.dumps(payload, separators=(",", ":")).encode(), "application/json")

    def _send(self, status, body, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        logger.debug("sglang-watchdog plugin %s - %s", self.address_string(), format % args)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
