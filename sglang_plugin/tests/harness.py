"""Test plumbing: hooks the stand-in mixins, runs scheduler loops, speaks HTTP."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from unittest import mock

from sglang_watchdog_plugin import hook

from . import standins

# The .pth path patches SGLang's mixin the same way.
hook.install(standins.PrefillMixin)
hook.install(standins.OldPrefillMixin)
hook.install(standins.EarlyPrefillMixin)
hook.install(standins.DecodeMixin, hook.DECODE_METHOD)


def plugin_env(**overrides):
    env = {
        "SGLANG_WATCHDOG_PLUGIN_HOST": "127.0.0.1",
        "SGLANG_WATCHDOG_PLUGIN_PORT": "0",
        "SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE": "",
        "SGLANG_WATCHDOG_PLUGIN_DISABLE": "",
    }
    env.update(overrides)
    return env


def start_loop(scheduler, env=None, **loop_args):
    """Starts the scheduler loop; returns (loop, monitor) once the first hooked pass ran."""
    loop = standins.SchedulerLoop(scheduler, **loop_args)
    with mock.patch.dict(os.environ, plugin_env() if env is None else env):
        loop.start()
        loop.wait_passes(2)
    return loop, hook.monitor_for(scheduler)


def free_ports(count):
    """A base port such that base .. base+count-1 are free on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no run of free ports found")


class Client:
    def __init__(self, port, host="127.0.0.1"):
        self.host = host
        self.port = port

    def request(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=15)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, response.getheader("Content-Type"), response.read()
        finally:
            conn.close()

    def get_json(self, path="/debug/inflight"):
        status, _, body = self.request("GET", path)
        return status, json.loads(body)

    def force_fail(self, payload, token=None, raw=None):
        return self.post_json("/admin/force_fail", payload, token, raw)

    def post_json(self, path, payload, token=None, raw=None):
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        body = raw if raw is not None else json.dumps(payload).encode()
        status, _, answer = self.request("POST", path, body=body, headers=headers)
        return status, json.loads(answer)


def wait_until(predicate, timeout=5.0, message="condition not reached"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.005)


def launch_standin(test, script, args, ready=r"READY plugin=(\d+) metrics=(\d+)\n"):
    """Starts a stand-in server script on free ports; the process is killed at the test's cleanup.

    Returns the process and the match of its READY line against ``ready`` (the plugin port, the metrics port).
    """
    proc = subprocess.Popen([sys.executable, script, "--port", "0", "--metrics-port", "0", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    test.addCleanup(stop_process, proc)
    line = proc.stdout.readline().decode()
    match = re.fullmatch(ready, line)
    if match is None:  # the process died or printed something else: show why
        proc.kill()
        test.fail(f"no READY line: {line!r}\n{proc.stderr.read().decode()}")
    return proc, match


def stop_process(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        stream.close()


def metric(port, name):
    """The value of the first sample of ``name`` on 127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)[1])
