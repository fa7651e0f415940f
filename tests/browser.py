"""Headless Chromium (Debian's `chromium`, installed by `make chromium`) with the network off.

Pages are loaded as on an air-gapped cluster: loopback answers, nothing else does.
Every request for another host goes to a local sink posing as the proxy, which
refuses it and records its target (`outside=`), so a test can both prove a page
works offline and see what it tried to fetch. Host names other than localhost do
not resolve either, for whatever would not use the proxy.

Chromium itself calls a few Google hosts whatever the page (component updates,
sign-in, network time), and no set of flags stops all of them in every version;
those are refused like the rest but left out of `outside`, which is the page's.

`needs_chromium` skips a test where chromium is missing, except under CI=true,
where a missing browser is a broken setup and the test fails.
"""
from __future__ import annotations

import os
import shutil
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = shutil.which("chromium")
# Headless Chromium runs the page's scripts, and waits on its fetches, for this
# much virtual time; it then dumps the DOM or takes the screenshot.
VIRTUAL_TIME_BUDGET_MS = 10_000
TIMEOUT_S = 60

# Exact hosts, not suffixes: a page's fonts.googleapis.com must still show.
BROWSER_OWN_HOSTS = frozenset({"accounts.google.com", "clients2.google.com", "update.googleapis.com"})

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("CI") != "true",
    reason="no chromium (make chromium installs it, as root)",
)


class _Refuse(socketserver.StreamRequestHandler):
    """`CONNECT host:443 HTTP/1.1` or `GET http://host/ HTTP/1.1`: record the target, answer 403."""

    def handle(self) -> None:
        line = self.rfile.readline(8192).decode("latin-1").split()
        if len(line) >= 2:
            self.server.targets.append(line[1])  # type: ignore[attr-defined]
        self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


@contextmanager
def _outside_sink() -> Iterator[tuple[int, list[str]]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Refuse)
    server.daemon_threads = True
    server.targets = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], server.targets  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def _host(target: str) -> str:
    """`host:443` (CONNECT) or `http://host/path` (a plain request through the proxy)."""
    return urlsplit(target if "://" in target else f"//{target}").hostname or target


def _run(url: str, mode: list[str], outside: list[str] | None) -> str:
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed (make chromium)")
    with _outside_sink() as (sink_port, targets), tempfile.TemporaryDirectory() as profile:
        command = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-quic", "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars",
            f"--user-data-dir={profile}",
            # Chromium never sends loopback through a proxy, so only the rest reaches the sink.
            f"--proxy-server=http://127.0.0.1:{sink_port}",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
            f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
            *mode, url,
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
        if outside is not None:
            outside.extend(t for t in targets if _host(t) not in BROWSER_OWN_HOSTS)
        return done.stdout


def dump_dom(url: str, *, outside: list[str] | None = None) -> str:
    """The page's DOM once its scripts have run, as HTML. `outside` receives the
    targets (host:port or URL) of every request that left loopback, all refused."""
    return _run(url, ["--dump-dom"], outside)


def screenshot(url: str, path: str | Path, width: int, height: int, *, outside: list[str] | None = None) -> Path:
    """A PNG of the page's first `width` x `height` CSS pixels, written to `path`."""
    path = Path(path).resolve()
    _run(url, [f"--screenshot={path}", f"--window-size={width},{height}"], outside)
    if not path.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {path}")
    return path
