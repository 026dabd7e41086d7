"""Listener settings, read from the environment of the scheduler process."""

import contextlib
import fcntl
import ipaddress
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("sglang_watchdog_plugin")

DEFAULT_HOST = "127.0.0.1"
# Below every port SGLang takes for itself with its default --port 30000
# (docs/deployment.md, "Ports"): --port + 100..1000 for NCCL up to v0.5.3, the
# kernel's ephemeral range (32768-60999) for NCCL and ZMQ's 49152-65535 from
# v0.5.10, --port + 233 and up for DP attention, 8998 for the bootstrap server.
DEFAULT_BASE_PORT = 28100
# The watchdog's --restart.min-interval default: the plugin holds the same
# floor itself, so that a sidecar that lost its memory cannot shorten it.
DEFAULT_RESTART_MIN_INTERVAL_S = 1800.0
RESTART_STAMP = "last-restart"


@dataclass(frozen=True)
class Config:
    host: str = DEFAULT_HOST
    # 0 lets the OS pick a free port for every rank (tests, stand-ins).
    base_port: int = DEFAULT_BASE_PORT
    # None: no token file named.
    token_file: "TokenFile | None" = None
    disabled: bool = False
    # POST /admin/restart ends the process: the operator opts in.
    allow_restart: bool = False
    restart_min_interval_s: float = DEFAULT_RESTART_MIN_INTERVAL_S
    # A directory that outlives the SGLang container (an emptyDir): the time
    # of the last restart is kept there, since the restart ends this process.
    state_dir: str = ""

    @classmethod
    def from_env(cls):
        env = os.environ
        if env.get("SGLANG_WATCHDOG_PLUGIN_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
            return cls(disabled=True)
        host = env.get("SGLANG_WATCHDOG_PLUGIN_HOST", "").strip() or DEFAULT_HOST
        port_text = env.get("SGLANG_WATCHDOG_PLUGIN_PORT", "").strip()
        base_port = int(port_text) if port_text else DEFAULT_BASE_PORT
        if not 0 <= base_port <= 65535:
            raise ValueError(f"SGLANG_WATCHDOG_PLUGIN_PORT={base_port} is not a TCP port")
        token_path = env.get("SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE", "").strip()
        allow_restart = env.get("SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART", "").strip() == "1"
        interval_text = env.get("SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL", "").strip()
        interval = float(interval_text) if interval_text else DEFAULT_RESTART_MIN_INTERVAL_S
        if not interval >= 0:  # also refuses nan
            raise ValueError(f"SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL={interval_text} is not a number of seconds >= 0")
        return cls(
            host=host, base_port=base_port, token_file=TokenFile(token_path) if token_path else None,
            allow_restart=allow_restart, restart_min_interval_s=interval,
            state_dir=env.get("SGLANG_WATCHDOG_PLUGIN_STATE_DIR", "").strip(),
        )

    def port_for(self, index):
        return 0 if self.base_port == 0 else self.base_port + index

    def token(self):
        """(token, unusable): the token as the file holds it now (None without one), and whether a named file is unusable."""
        return self.token_file.read() if self.token_file is not None else (None, False)

    @property
    def restart_stamp_path(self):
        return os.path.join(self.state_dir, RESTART_STAMP) if self.state_dir else ""


def admin_allowed(host, token, unusable):
    """Whether /admin/* may be served at all (a token may still be required).

    A token file that was named but cannot be used keeps /admin/* closed
    rather than open without the token the operator asked for.
    """
    if unusable:
        return False
    return token is not None or is_loopback(host)


class TokenFile:
    """The token file, read again whenever it changes, so a rotated token applies without a restart.

    Kubernetes updates a Secret volume by swapping a symlink to a new
    directory, so the file's inode and mtime change; a stat per request is
    all an unchanged file costs.
    """

    def __init__(self, path):
        self.path = path
        self._lock = threading.Lock()
        self._key = None
        self._state = (None, True)

    def read(self):
        try:
            st = os.stat(self.path)
            key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError as e:
            key = ("error", e.errno)
        with self._lock:
            if key != self._key:
                # Logs (in _read_token) once per change, not once per request.
                self._key = key
                self._state = _read_token(self.path)
                if self._state[0] is not None:
                    logger.info("sglang-watchdog plugin read its token from %s", self.path)
            return self._state


def _read_token(path):
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as e:
        logger.error("cannot read SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE %s (%s); /admin/* stays closed", path, e.strerror)
        return None, True
    if not token:
        logger.error("SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE %s is empty; /admin/* stays closed", path)
        return None, True
    bad = next((i for i, byte in enumerate(token) if byte <= 0x20 or byte == 0x7F), None)
    if bad is not None:
        # A token with a line break or a space inside is a file written wrong
        # (two tokens, or a pasted header), never a secret to match.
        logger.error(
            "SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE %s: the token has whitespace or a control character (byte 0x%02x) "
            "at offset %d inside it; /admin/* stays closed", path, token[bad], bad,
        )
        return None, True
    return token, False


def last_restart(path):
    """The wall-clock time of the last restart recorded at path, or None."""
    try:
        with open(path, encoding="ascii") as f:
            when = float(f.read().strip())
        if not math.isfinite(when):
            raise ValueError(f"{when} is not a time")
        return when
    except FileNotFoundError:
        return None
    except ValueError:
        # A stamp written wrong still tells when it was written.
        return os.stat(path).st_mtime
    except OSError as e:
        # An unreadable stamp must not lift the floor: count it as a restart now.
        logger.error("sglang-watchdog plugin cannot read its restart stamp %s (%s); restarts wait a full interval", path, e)
        return time.time()


@contextlib.contextmanager
def restart_lock(path):
    """Holds an exclusive lock on path's lock file: every rank of the server shares the stamp,
    so a check and its record must not interleave with another rank's."""
    with open(f"{path}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def record_restart(path, when):
    """Writes the restart time to path, atomically (every rank of the pod shares it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{when:.3f}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
