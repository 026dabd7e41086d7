"""Listener settings, read from the environment of the scheduler process."""

import ipaddress
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("sglang_watchdog_plugin")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_BASE_PORT = 30100


@dataclass(frozen=True)
class Config:
    host: str = DEFAULT_HOST
    # 0 lets the OS pick a free port for every rank (tests, stand-ins).
    base_port: int = DEFAULT_BASE_PORT
    token: bytes | None = None
    # A token file was named but could not be used: /admin/* stays closed
    # rather than open without the token the operator asked for.
    token_unusable: bool = False
    disabled: bool = False
    # POST /admin/restart ends the process: the operator opts in.
    allow_restart: bool = False

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
        token, unusable = _read_token(env.get("SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE", "").strip())
        allow_restart = env.get("SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART", "").strip() == "1"
        return cls(host=host, base_port=base_port, token=token, token_unusable=unusable, allow_restart=allow_restart)

    def port_for(self, index):
        return 0 if self.base_port == 0 else self.base_port + index

    @property
    def admin_allowed(self):
        """Whether /admin/* may be served at all (a token may still be required)."""
        if self.token_unusable:
            return False
        return self.token is not None or is_loopback(self.host)


def _read_token(path):
    if not path:
        return None, False
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


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
