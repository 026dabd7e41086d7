"""HTTP listener (prefill and decode): GET /healthz, GET /debug/inflight, POST /admin/force_fail, POST /admin/restart,
POST /admin/wedge_order.

The contract is docs/plugin-api.md, including its "Project clarifications".
Handlers run on the listener's own threads and only read the Monitor's
published state; force-fail orders are handed to the scheduler thread, and
wedge orders left for it (wedge.py).

Limits, so that no client can pile up threads in the scheduler process: at
most MAX_CONNECTIONS connections are served at once (one more is answered 503
and closed at once, by the accepting thread, without blocking), and each
request (request line, headers and body) must arrive within
REQUEST_DEADLINE_S of the connection's start, or the connection is closed.
"""

import hmac
import io
import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .config import admin_allowed, last_restart, record_restart, restart_lock
from .orders import Outcome, bad_request, unauthorized
from .wedge import MAX_TTL_S

logger = logging.getLogger("sglang_watchdog_plugin")

MAX_BODY_BYTES = 64 * 1024
# Reading the rest of an over-long body before closing keeps the client from
# seeing a connection reset instead of our answer; past this, just close.
_DRAIN_LIMIT_BYTES = 1024 * 1024
_ROOM_LIMIT = 2**64

MAX_CONNECTIONS = 16
REQUEST_DEADLINE_S = 10.0
# Socket timeout of each read and of each write of the answer.
IO_TIMEOUT_S = 10.0
_REFUSAL_LOG_INTERVAL_S = 60.0
_ADMIN_PATHS = ("/admin/force_fail", "/admin/restart", "/admin/wedge_order")


def _busy_response(limit):
    body = json.dumps(
        {"result": "busy", "error": f"the listener already serves {limit} connections; try again later"},
        separators=(",", ":"),
    ).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\n"
        "Server: sglang-watchdog-plugin\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


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
        # Nothing else can report it: this rank serves no listing, and the
        # watchdog's --plugin.url for it reads sglang_watchdog_scrape_success
        # {source="plugin"} 0 (alert SGLangWatchdogPluginScrapeFailing).
        logger.error(
            "sglang-watchdog plugin cannot listen on %s port %d (%s); it stays off for dp_rank=%d pp_rank=%d. "
            "Another process holds the port: with SGLANG_WATCHDOG_PLUGIN_PORT inside SGLang's own ports "
            "(NCCL, DP attention, another server on a hostNetwork node), move it "
            "(docs/deployment.md, \"Ports\")",
            config.host, port, e, ident.dp_rank, ident.pp_rank,
        )
        return None
    token, unusable = config.token()
    logger.info(
        "sglang-watchdog plugin listening on %s port %d (dp_rank=%d pp_rank=%d tp_rank=%d backend=%s token=%s)",
        listener.host, listener.port, ident.dp_rank, ident.pp_rank, ident.tp_rank, ident.backend,
        "set" if token is not None else "not set",
    )
    allowed = admin_allowed(config.host, token, unusable)
    if allowed and token is None:
        logger.warning(
            "sglang-watchdog plugin serves /admin/* on %s without a token: every process that can reach this "
            "address (on loopback, every process in the pod) can force-fail requests; "
            "set SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE to require one",
            config.host,
        )
    if not allowed:
        logger.warning(
            "sglang-watchdog plugin refuses /admin/* on %s until SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE holds a usable "
            "token (it is read again when it changes; a token is required off loopback); /debug/inflight and "
            "/healthz stay open",
            config.host,
        )
    if config.allow_restart and not config.state_dir:
        logger.warning(
            "sglang-watchdog plugin allows restarts but has no SGLANG_WATCHDOG_PLUGIN_STATE_DIR: it cannot keep "
            "its minimum interval between restarts (%.0f s) across them; mount a volume that outlives the "
            "container (an emptyDir) and name it there",
            config.restart_min_interval_s,
        )
    return listener


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._busy_response = _busy_response(self.max_connections)
        self._refused = 0
        self._next_refusal_log = 0.0
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        # Runs on the accepting thread: must never block.
        if not self._slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request, client_address):
        try:
            request.setblocking(False)
            try:
                # Whatever of the request has already arrived: closing with
                # unread bytes would reset the connection before the client
                # reads the answer.
                request.recv(65536)
            except OSError:
                pass
            request.send(self._busy_response)  # a few hundred bytes into an empty send buffer
        except OSError:
            pass
        self.shutdown_request(request)
        self._refused += 1
        now = time.monotonic()
        if now >= self._next_refusal_log:
            logger.warning(
                "sglang-watchdog plugin refused %d connection(s) (latest from %s): all %d connection slots are busy",
                self._refused, client_address[0], self.max_connections,
            )
            self._refused = 0
            self._next_refusal_log = now + _REFUSAL_LOG_INTERVAL_S

    def handle_error(self, request, client_address):
        # Mostly clients going away mid-answer: not worth a traceback on stderr.
        logger.debug("sglang-watchdog plugin: error while serving %s", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    monitor = None
    config = None
    server_version = "sglang-watchdog-plugin"
    timeout = IO_TIMEOUT_S
    # A stalled or trickling client must not hold a listener thread forever:
    # the whole request must arrive within this many seconds.
    request_deadline = REQUEST_DEADLINE_S

    def setup(self):
        super().setup()
        self.rfile.close()  # the plain socket reader; the socket itself stays open
        deadline = time.monotonic() + self.request_deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, self.timeout))

    def do_GET(self):
        self._answer(self._get)

    def do_POST(self):
        self._answer(self._post)

    def _answer(self, handle):
        # Whatever escapes a handler gets a 500 answer, not a dropped connection.
        try:
            handle()
        except (OSError, TimeoutError):
            raise  # the connection itself failed: nothing can be answered on it
        except Exception:
            logger.exception("sglang-watchdog plugin: %s %s failed", self.command, self.path)
            if not self._answered:
                self.close_connection = True
                self._send_json(500, {"result": "internal_error", "error": "the plugin failed; see the scheduler log"})

    def _get(self):
        path = urlsplit(self.path).path
        if path == "/healthz":
            self._send(200, b"ok", "text/plain; charset=utf-8")
        elif path == "/debug/inflight":
            self._send_json(200, self.monitor.listing())
        elif path in _ADMIN_PATHS:
            self._send_json(405, {"error": f"use POST for {path}"})
        else:
            self._send_json(404, {"error": f"no endpoint at {path}"})

    def _post(self):
        path = urlsplit(self.path).path
        if path not in _ADMIN_PATHS:
            self._send_json(404, {"error": f"no endpoint at {path}"})
            self._drain(self._content_length() or 0)
            return
        length = self._content_length()
        outcome = self._refusal(path) or self._body_problem(length)
        if outcome is not None:
            self._send_json(outcome.status, self._for_path(path, outcome.body))
            self._drain(length or 0)
            return
        payload = _json_object(self.rfile.read(length))
        if isinstance(payload, Outcome):
            self._send_json(payload.status, self._for_path(path, payload.body))
        elif path == "/admin/force_fail":
            outcome = self._force_fail(payload)
            self._send_json(outcome.status, outcome.body)
        elif path == "/admin/wedge_order":
            outcome = self._wedge_order(payload)
            self._send_json(outcome.status, self._for_path(path, outcome.body))
        else:
            self._restart(payload)

    @staticmethod
    def _for_path(path, body):
        # Every answer of /admin/restart names this process; every one of /admin/wedge_order lists failed rooms.
        if path == "/admin/restart":
            return {**body, "pid": os.getpid()}
        if path == "/admin/wedge_order":
            return {**body, "failed": body.get("failed", [])}
        return body

    def _refusal(self, path):
        config = self.config
        token, unusable = config.token()  # per request: a rotated token applies at once
        if not admin_allowed(config.host, token, unusable):
            return unauthorized("/admin/* is disabled on this listener: it needs a usable token off loopback")
        if token is None:
            if path == "/admin/restart":
                return unauthorized("/admin/restart needs a token: set SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE")
            return None
        scheme, _, credentials = self.headers.get("Authorization", "").partition(" ")
        try:
            presented = credentials.strip().encode("latin-1")
        except UnicodeEncodeError:
            presented = b""
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented, token):
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

    def _force_fail(self, payload):
        rid = payload.get("rid")
        if not isinstance(rid, str) or not rid:
            return bad_request("rid must be a non-empty string")
        room = payload.get("bootstrap_room")
        if "bootstrap_room" in payload and not (_is_int(room) and 0 <= room < _ROOM_LIMIT):
            return bad_request("bootstrap_room must be an integer in [0, 2^64)")
        dry_run = payload.get("dry_run", False)
        if not isinstance(dry_run, bool):
            return bad_request("dry_run must be a boolean")
        prefill_stopped = payload.get("prefill_stopped", False)
        if not isinstance(prefill_stopped, bool):
            return bad_request("prefill_stopped must be a boolean")
        reason = payload.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            reason = None
        return self.monitor.force_fail(rid, room, reason, dry_run, prefill_stopped)

    def _wedge_order(self, payload):
        outcome = wedge_order_problem(payload)
        if outcome is not None:
            return outcome
        reason = payload.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            reason = None
        return self.monitor.wedge_order(payload["transfer_queue"], payload["chunk"], float(payload["ttl_seconds"]),
                                        float(payload.get("min_age_seconds", 0)), reason,
                                        payload.get("dry_run", False))

    def _restart(self, payload):
        monitor = self.monitor
        pid = payload.get("pid")
        dry_run = payload.get("dry_run", False)
        reason = payload.get("reason")
        if not (_is_int(pid) and pid > 0):
            outcome = bad_request("pid must be a positive integer: the pid of the process to restart")
        elif not isinstance(dry_run, bool):
            outcome = bad_request("dry_run must be a boolean")
        elif not self.config.allow_restart:
            outcome = Outcome(403, {"result": "restart_disabled", "pid": os.getpid(),
                                    "error": "restarts are not allowed in this process; the operator enables them "
                                             "with SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=1"})
        else:
            outcome = monitor.restart(pid, dry_run)
            if outcome.status in (200, 202):
                outcome = self._restart_floor(outcome)
        self.close_connection = outcome.status == 202
        self._send_json(outcome.status, self._for_path("/admin/restart", outcome.body))
        if outcome.status != 202:
            return
        self.wfile.flush()
        try:
            self.connection.shutdown(socket.SHUT_WR)  # the client sees the whole answer before the process ends
        except OSError:
            pass
        reason = reason if isinstance(reason, str) and reason.strip() else None
        threading.Thread(target=monitor.end_process, args=(reason,), name="sglang-watchdog-plugin-restart",
                         daemon=True).start()

    def _restart_floor(self, outcome):
        """The plugin's own minimum interval between restarts of this server, kept in the state directory.

        The watchdog keeps --restart.min-interval too, but in its memory: a
        sidecar that restarts would otherwise restart SGLang again at once.
        A dry run answers as the real call would, and records nothing.
        """
        path = self.config.restart_stamp_path
        if not path:
            return outcome
        try:
            with restart_lock(path):
                return self._restart_floor_locked(outcome, path)
        except OSError as e:
            # Restarting without the record would lift the floor for the next one.
            logger.error("sglang-watchdog plugin refuses a restart: cannot use %s (%s)", path, e)
            return Outcome(500, {"result": "internal_error",
                                 "error": "cannot record the restart in SGLANG_WATCHDOG_PLUGIN_STATE_DIR"})

    def _restart_floor_locked(self, outcome, path):
        now = time.time()
        last = last_restart(path)
        wait = self.config.restart_min_interval_s - (now - last) if last is not None else 0
        if wait > 0:
            logger.warning("sglang-watchdog plugin refuses a restart: the last one was %.0f s ago (minimum interval "
                           "%.0f s, SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL)", now - last,
                           self.config.restart_min_interval_s)
            return Outcome(429, {"result": "too_soon", "retry_after_s": int(wait) + 1,
                                 "error": f"the last restart of this server was {now - last:.0f} s ago; the plugin "
                                          f"allows one per {self.config.restart_min_interval_s:.0f} s"})
        if outcome.status == 202:
            record_restart(path, now)
        return outcome

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

    _answered = False

    def _send_json(self, status, payload):
        self._send(status, json.dumps(payload, separators=(",", ":")).encode(), "application/json")

    def _send(self, status, body, content_type):
        self._answered = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        logger.debug("sglang-watchdog plugin %s - %s", self.address_string(), format % args)


class _DeadlineReader(io.RawIOBase):
    """The connection's socket, readable until a deadline; then every read raises TimeoutError.

    BaseHTTPRequestHandler closes the connection on TimeoutError, whether it
    comes while reading the request line, the headers or the body.
    """

    def __init__(self, sock, deadline, io_timeout):
        self._sock = sock
        self._deadline = deadline
        self._io_timeout = io_timeout

    def readable(self):
        return True

    def readinto(self, buffer):
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self._sock.settimeout(min(remaining, self._io_timeout))
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._io_timeout)  # for writing the answer


def _json_object(body):
    """The body as a dict, or the 400 Outcome that says why not."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: brackets nested deeper than the parser's stack.
        return bad_request("body is not valid JSON")
    if not isinstance(payload, dict):
        return bad_request("body must be a JSON object")
    return payload


def wedge_order_problem(payload):
    """The 400 answer naming the first field of a wedge order that is missing or wrong, else None."""
    for field in ("transfer_queue", "chunk"):
        value = payload.get(field)
        if field not in payload:
            return bad_request(f"{field} is required: an integer >= 0")
        if not (_is_int(value) and value >= 0):
            return bad_request(f"{field} must be an integer >= 0, not {json.dumps(value)}")
    ttl = payload.get("ttl_seconds")
    if "ttl_seconds" not in payload:
        return bad_request(f"ttl_seconds is required: a number in (0, {MAX_TTL_S:g}]")
    if not (_is_number(ttl) and 0 < ttl <= MAX_TTL_S):
        return bad_request(f"ttl_seconds must be a number in (0, {MAX_TTL_S:g}], not {json.dumps(ttl)}")
    min_age = payload.get("min_age_seconds", 0)
    if not (_is_number(min_age) and min_age >= 0):
        return bad_request(f"min_age_seconds must be a number >= 0, not {json.dumps(min_age)}")
    if not isinstance(payload.get("dry_run", False), bool):
        return bad_request("dry_run must be a boolean")
    reason = payload.get("reason")
    if reason is not None and not isinstance(reason, str):
        return bad_request("reason must be a string")
    return None


def _is_number(value):
    # json.loads gives inf and nan for Infinity and NaN: neither is a duration.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
