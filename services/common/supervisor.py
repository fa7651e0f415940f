"""Run the whole chain locally as separate processes: worker(s) → scheduler →
tokenizer → http_edge. `make run` uses it; so do the end-to-end tests.

Prints the URL, and every `/metrics` URL, once `/health` answers 200. SIGINT/SIGTERM stop every child
(each drains gracefully, then is killed if it lingers); children also get
SIGTERM if this process dies, so nothing is orphaned.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 15.0
# Set in each child's environment to our pid: see exit_with_supervisor.
SUPERVISOR_PID_ENV = "STORMSERVE_SUPERVISOR_PID"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_with_supervisor() -> None:
    """Called first by each service's main: if a supervisor started it, the service
    gets SIGTERM (and drains) when the supervisor dies, even by SIGKILL.

    The child asks for this itself rather than in a Popen preexec_fn: a preexec_fn
    makes Popen fork instead of vfork, so the fork handlers of gRPC (which the
    tests use in the same process) run in the child and can abort it before it
    execs (grpcio 1.81 and later, grpc/grpc#43055)."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if supervisor is None:
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):  # it died before we asked
        raise SystemExit(f"the supervisor (pid {supervisor}) that started this service is gone")


@dataclass
class Chain:
    host: str = "127.0.0.1"
    edge_port: int = 8000
    tokenizer_port: int = 50051
    scheduler_port: int = 50052
    worker_ports: list[int] = field(default_factory=lambda: [50053])
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # None: children write to our stdout/stderr
    # The gRPC services' /metrics ports by process name (the edge serves its own on
    # its HTTP port); one missing is given a free port at start. metrics=False: none.
    metrics: bool = True
    metrics_ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _commands: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.edge_port}"

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every process's Prometheus endpoint, by process name."""
        urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}
        return {"http_edge": self.url + "/metrics", **urls}

    def _metrics_flag(self, name: str) -> tuple[str, ...]:
        if not self.metrics:
            return ()
        return ("--metrics-port", str(self.metrics_ports.setdefault(name, free_port())))

    def start(self) -> None:
        workers = [f"127.0.0.1:{p}" for p in self.worker_ports]
        # Internal services stay on loopback whatever STORMSERVE_HOST says (it is the edge's).
        internal = ("--host", "127.0.0.1")
        for i, port in enumerate(self.worker_ports):
            self._spawn(f"worker{i}", "services.worker", *internal, "--port", str(port),
                        *self._metrics_flag(f"worker{i}"))
        self._spawn("scheduler", "services.scheduler", *internal, "--port", str(self.scheduler_port),
                    "--worker-addresses", ",".join(workers), *self._metrics_flag("scheduler"))
        self._spawn("tokenizer", "services.tokenizer", *internal, "--port", str(self.tokenizer_port),
                    "--scheduler-address", f"127.0.0.1:{self.scheduler_port}", *self._metrics_flag("tokenizer"))
        self._spawn("http_edge", "services.http_edge", "--host", self.host, "--port", str(self.edge_port),
                    "--tokenizer-address", f"127.0.0.1:{self.tokenizer_port}")

    def restart(self, name: str) -> None:
        """Start `name` again with its original arguments (after it died or was stopped)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._spawn(name, *self._commands[name])

    def _spawn(self, name: str, module: str, *args: str) -> None:
        self._commands[name] = (module, *args)
        env = {**os.environ, **self.env, SUPERVISOR_PID_ENV: str(os.getpid())}
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join([str(root / "gen"), str(root), env.get("PYTHONPATH", "")])
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, cwd=root, stdout=out, stderr=out,
            # Own session: a terminal's Ctrl-C reaches only us, and we stop the
            # children in order with SIGTERM.
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} during start-up{self._log_hint(name)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the chain did not become healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        """Front to back, so each service drains while the one behind it still answers."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _log_hint(self, name: str) -> str:
        if self.log_dir is None:
            return ""
        text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return ":\n" + text[-3000:]


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the stormserve chain locally.")
    parser.add_argument("--host", default=os.environ.get("STORMSERVE_HOST", "127.0.0.1"),
                        help="edge listen address (env STORMSERVE_HOST)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("STORMSERVE_PORT", "8000")),
                        help="edge port (env STORMSERVE_PORT)")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("STORMSERVE_WORKERS", "1")),
                        help="number of worker processes (env STORMSERVE_WORKERS)")
    args = parser.parse_args()
    # Metrics ports next to the edge's: tokenizer +1, scheduler +2, workers +3 on.
    metrics_ports = {"tokenizer": args.port + 1, "scheduler": args.port + 2,
                     **{f"worker{i}": args.port + 3 + i for i in range(args.workers)}}
    chain = Chain(host=args.host, edge_port=args.port,
                  worker_ports=[50053 + i for i in range(args.workers)], metrics_ports=metrics_ports)
    stopping = False
    exit_code = 0

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        chain.start()
        chain.wait_ready()
        print(f"stormserve is ready: {chain.url}/v1/chat/completions", flush=True)
        for name, url in chain.metrics_urls.items():
            print(f"  metrics of {name}: {url}", flush=True)
        while all(p.poll() is None for p in chain.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in chain.procs.items() if p.poll() is not None]
        print(f"stopping: {', '.join(dead)} exited", file=sys.stderr, flush=True)
        exit_code = 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        chain.stop()
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
