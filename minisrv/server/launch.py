"""Start a server for a script or a notebook, and always stop it: ``running_server`` runs
``minisrv serve`` as a subprocess (the way a reader runs it in a terminal), ``serving_app``
runs an app built in this process under uvicorn in a thread (so the caller can look inside
its engine while it serves). Both bind a free port on 127.0.0.1 and yield the base URL once
``/health`` answers 200.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["free_port", "running_server", "serving_app", "wait_healthy"]

_LAUNCH = "import sys\nfrom minisrv.server.cli import main\nmain(sys.argv[1:])\n"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout_s: float, alive: Any = None) -> None:
    """Poll ``url``/health until it answers 200; RuntimeError after ``timeout_s`` or as soon
    as ``alive()`` says the server is gone."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"the server at {url} stopped while starting")
        try:
            answer = httpx.get(f"{url}/health", timeout=5)
            if answer.status_code == 200:
                return
            if answer.json().get("status") == "failed":
                raise RuntimeError(f"the server at {url} failed: {answer.json().get('error')}")
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.05)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout_s} s")


@contextmanager
def running_server(args: Sequence[str] = (), startup_s: float = 120.0,
                   module: str | None = None) -> Iterator[str]:
    """``minisrv serve ARGS`` in a subprocess on a free port; yields its base URL and
    terminates it on exit (killing it if it does not stop within 15 s). ``module`` runs
    ``python -m MODULE ARGS`` instead, a command taking the serve flags (the book's
    ``minisrv.sim.served``)."""
    port = free_port()
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    head = ["-c", _LAUNCH, "serve"] if module is None else ["-m", module]
    cmd = [sys.executable, *head, "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": path},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, startup_s, alive=lambda: proc.poll() is None)
        except RuntimeError as exc:
            err = proc.stderr.read()[-2000:] if proc.poll() is not None and proc.stderr else ""
            raise RuntimeError(f"{exc}\n{err}") from None
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stderr is not None:
            proc.stderr.close()


@contextmanager
def serving_app(app: Any, startup_s: float = 120.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread of this process on a free port; yields the base
    URL once healthy and shuts the server (and the app's engines) down on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="minisrv-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, startup_s, alive=thread.is_alive)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
