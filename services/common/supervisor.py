"""Run the whole chain locally as separate processes: worker(s) → scheduler →
tokenizer → http_edge, and Envoy in front when STORMSERVE_ENVOY=1 (on
STORMSERVE_ENVOY_PORT, default 8080; services/envoy, deploy/envoy). `make run` uses it; so do
the end-to-end tests.

Prints the URL, and every `/metrics` URL, once `/health` answers 200. From then on a service that exits
is started again, as Kubernetes restarts a crashed container: after 1 s, then
twice as long after each crash, at most 30 s, back to 1 s once it has stayed
up 60 s. Each restart is logged (service, exit code or signal, delay). The
services behind and in front of it reconnect by themselves. A service that
dies during start-up stops the chain instead: that is a setup error, which
restarting would only repeat.

The internal_tls_* settings (services/common/tls.py; STORMSERVE_INTERNAL_TLS_*)
reach every child through the environment, as every setting does; with them the
edge serves HTTPS and this process checks its /health with the internal CA.

SIGINT/SIGTERM stop every child (each drains gracefully, then is killed if it
lingers) and no restart happens after that; children also get SIGTERM if this
process dies, so nothing is orphaned.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config import env_name, load_config, parse_bool
from services.common.drain import DEFAULT_DRAIN_TIMEOUT_S
from services.common.log import setup_logging
from services.common.tls import InternalTls, InternalTlsSettings

if TYPE_CHECKING:  # every service imports this module; only the supervisor needs Envoy's
    from services.envoy.config import EnvoyConfig

log = logging.getLogger("stormserve.supervisor")

PR_SET_PDEATHSIG = 1
# A stopped service may drain for its drain timeout; this much more to exit before it is killed.
STOP_MARGIN_S = 10.0
# Restarts: the first after INITIAL_BACKOFF_S, each next one twice as late, at
# most MAX_BACKOFF_S; a service that stayed up STABLE_AFTER_S starts over.
INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
SUPERVISE_POLL_S = 0.5
# Set in each child's environment to our pid: see exit_with_supervisor.
SUPERVISOR_PID_ENV = "STORMSERVE_SUPERVISOR_PID"


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now that this process has not handed out before. The kernel
    may give a released port out again, and two services of a chain given the same
    one would both bind it (gRPC servers bind with SO_REUSEPORT) and answer each
    other's calls ("Method not found")."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


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
    # Serving groups beyond the first: each a scheduler on its port (the first group's is
    # scheduler_port), the workers dealt to the groups in turn; the tokenizer spreads
    # requests over them. Processes are then named scheduler<g> and worker<i>.
    group_scheduler_ports: list[int] = field(default_factory=list)
    # Each worker's role (services.worker --role) by index; none given: every one both.
    worker_roles: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # None: children write to our stdout/stderr
    # The gRPC services' /metrics ports by process name (the edge serves its own on
    # its HTTP port); one missing is given a free port at start. metrics=False: none.
    metrics: bool = True
    metrics_ports: dict[str, int] = field(default_factory=dict)
    # Plaintext health-only ports (services/common/tls.py) by process name; none by default.
    health_ports: dict[str, int] = field(default_factory=dict)
    # Envoy in front of the edge and the tokenizer (deploy/envoy), started last;
    # its edge and tokenizer ports are this chain's. None: no Envoy.
    envoy: EnvoyConfig | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic  # for the restart delays
    restarts: dict[str, int] = field(default_factory=dict)  # per service, since start
    _commands: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False)
    _started_at: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _backoff_s: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _restart_at: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # dead, waiting
    _stopping: bool = field(default=False, init=False, repr=False)
    # Held by `heal` and by `stop` while it marks the chain stopping: no restart after that.
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def internal_tls(self) -> InternalTls | None:
        """Internal mutual TLS as the children see it (their environment); None when off."""
        return InternalTls.of(load_config(InternalTlsSettings, argv=[], environ={**os.environ, **self.env}))

    @property
    def url(self) -> str:
        return f"{'https' if self.internal_tls else 'http'}://{self.host}:{self.edge_port}"

    @property
    def envoy_url(self) -> str | None:
        return None if self.envoy is None else self.envoy.url

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every process's Prometheus endpoint, by process name."""
        urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}
        return {"http_edge": self.url + "/metrics", **urls}

    def _metrics_flag(self, name: str) -> tuple[str, ...]:
        if not self.metrics:
            return ()
        return ("--metrics-port", str(self.metrics_ports.setdefault(name, free_port())))

    def _health_flag(self, name: str) -> tuple[str, ...]:
        return ("--health-port", str(self.health_ports[name])) if name in self.health_ports else ()

    def _group_flag(self, group: int) -> tuple[str, ...]:
        """A scheduler's or worker's serving group (its metrics' `group` label): its index,
        with several groups; one group keeps the setting's default (or the operator's)."""
        return ("--serving-group", str(group)) if self.group_scheduler_ports else ()

    def _threads_flag(self) -> tuple[str, ...]:
        """Workers on one host share its cores: unless the operator set
        NUM_THREADS, each gets its part, or their thread teams (each as large as
        the host) wait on each other at every barrier."""
        if len(self.worker_ports) < 2 or "STORMSERVE_NUM_THREADS" in {**os.environ, **self.env}:
            return ()
        return ("--num-threads", str(max(1, len(os.sched_getaffinity(0)) // len(self.worker_ports))))

    @property
    def scheduler_ports(self) -> list[int]:
        """Every serving group's scheduler port, the first group's first."""
        return [self.scheduler_port, *self.group_scheduler_ports]

    @property
    def scheduler_names(self) -> list[str]:
        """The schedulers' process names, in group order."""
        if not self.group_scheduler_ports:
            return ["scheduler"]
        return [f"scheduler{g}" for g in range(len(self.scheduler_ports))]

    def group_workers(self, group: int) -> list[int]:
        """The indexes of the workers of serving group `group`: dealt in turn."""
        return list(range(group, len(self.worker_ports), len(self.scheduler_ports)))

    def start(self) -> None:
        # (One scheduler may start with no worker: it finds them through Kubernetes.)
        if self.group_scheduler_ports and len(self.worker_ports) < len(self.scheduler_ports):
            raise ValueError(f"{len(self.scheduler_ports)} serving groups need at least as many workers, "
                             f"got {len(self.worker_ports)}")
        # Internal services stay on loopback whatever STORMSERVE_HOST says (it is the edge's).
        internal = ("--host", "127.0.0.1")
        for i, port in enumerate(self.worker_ports):
            self._spawn(f"worker{i}", "services.worker", *internal, "--port", str(port),
                        *self._metrics_flag(f"worker{i}"), *self._threads_flag(), *self._health_flag(f"worker{i}"),
                        *self._group_flag(i % len(self.scheduler_ports)),
                        *(("--role", self.worker_roles[i]) if self.worker_roles else ()))
        for group, (name, port) in enumerate(zip(self.scheduler_names, self.scheduler_ports)):
            workers = [f"127.0.0.1:{self.worker_ports[i]}" for i in self.group_workers(group)]
            self._spawn(name, "services.scheduler", *internal, "--port", str(port),
                        "--worker-addresses", ",".join(workers), *self._metrics_flag(name),
                        *self._health_flag(name), *self._group_flag(group))
        schedulers = ",".join(f"127.0.0.1:{port}" for port in self.scheduler_ports)
        self._spawn("tokenizer", "services.tokenizer", *internal, "--port", str(self.tokenizer_port),
                    *(("--scheduler-address", schedulers) if not self.group_scheduler_ports
                      else ("--scheduler-addresses", schedulers)),
                    *self._metrics_flag("tokenizer"), *self._health_flag("tokenizer"))
        self._spawn("http_edge", "services.http_edge", "--host", self.host, "--port", str(self.edge_port),
                    "--tokenizer-address", f"127.0.0.1:{self.tokenizer_port}")
        if self.envoy is not None:
            from services.envoy.render import as_flags

            self.envoy = replace(self.envoy, edge_address=f"127.0.0.1:{self.edge_port}",
                                 tokenizer_address=f"127.0.0.1:{self.tokenizer_port}")
            self._spawn("envoy", "services.envoy", *as_flags(self.envoy))

    def restart(self, name: str) -> None:
        """Start `name` again with its original arguments (after it died or was stopped)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._restart_at.pop(name, None)
        self._spawn(name, *self._commands[name])

    def heal(self) -> list[str]:
        """One look at the children: a service found dead is logged and given its
        restart delay; one whose delay has passed is started again. Returns the
        services started. Does nothing once `stop` (or `request_stop`) was called."""
        started = []
        with self._lock:
            if self._stopping:
                return started
            now = self.clock()
            for name, proc in list(self.procs.items()):
                if proc.poll() is None:
                    continue
                due = self._restart_at.get(name)
                if due is None:
                    self._restart_at[name] = now + self._next_backoff(name, now)
                    log.warning("%s %s after %.1f s up; restarting it in %g s", name, exit_reason(proc.returncode),
                                now - self._started_at[name], self._restart_at[name] - now)
                elif now >= due:
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    log.warning("restarting %s (restart %d)", name, self.restarts[name])
                    try:
                        self.restart(name)
                    except OSError as exc:  # found dead again by the next look, given the next delay
                        log.error("could not restart %s: %s", name, exc)
                        continue
                    started.append(name)
        return started

    def _next_backoff(self, name: str, now: float) -> float:
        """The delay before restarting `name`, which just died; the one after is doubled."""
        delay = self._backoff_s.get(name, INITIAL_BACKOFF_S)
        if now - self._started_at[name] >= STABLE_AFTER_S:
            delay = INITIAL_BACKOFF_S  # it had recovered: a new crash is not part of a loop
        self._backoff_s[name] = min(delay * 2, MAX_BACKOFF_S)
        return delay

    def supervise(self, poll_s: float = SUPERVISE_POLL_S) -> None:
        """Keep the chain up (see `heal`) until `stop` or `request_stop`.

        Run it on a thread that lives as long as the chain (`make run`: the main
        one): a child's parent-death signal follows the thread that started it."""
        while not self._stopping:
            self.heal()
            time.sleep(poll_s)

    def request_stop(self) -> None:
        """Ends `supervise` and prevents restarts; safe in a signal handler (takes no lock)."""
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _spawn(self, name: str, module: str, *args: str) -> None:
        self._commands[name] = (module, *args)
        env = {**os.environ, **self.env, SUPERVISOR_PID_ENV: str(os.getpid())}
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join([str(root / "gen"), str(root), env.get("PYTHONPATH", "")])
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
            if name in self.procs:
                out.write(f"--- {name} restarted by the supervisor ---\n".encode())
                out.flush()
        try:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, *args], env=env, cwd=root, stdout=out, stderr=out,
                # Own session: a terminal's Ctrl-C reaches only us, and we stop the
                # children in order with SIGTERM.
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()  # the child has its own copy
        self._started_at[name] = self.clock()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} during start-up{self._log_hint(name)}")
            if self._healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"the chain did not become healthy within {timeout_s:.0f} s")

    def _healthy(self) -> bool:
        tls = self.internal_tls
        context = tls.client_ssl_context() if tls is not None else None
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2, context=context) as reply:
                if reply.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
        if self.envoy is None:
            return True
        if self.envoy.envoy_cert_file:  # TLS (maybe mutual): Envoy is up once it accepts connections
            try:
                socket.create_connection((self.envoy.envoy_host, self.envoy.envoy_port), timeout=2).close()
                return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(self.envoy.url + "/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def stop_grace_s(self) -> float:
        """How long a service may take to stop: the drain timeout it runs with, and a margin."""
        name = env_name("drain_timeout_s")
        drain_s = self.env.get(name) or os.environ.get(name) or DEFAULT_DRAIN_TIMEOUT_S
        return float(drain_s) + STOP_MARGIN_S

    def stop(self) -> None:
        """Front to back, so each service drains while the one behind it still answers.
        Nothing is restarted from the moment it is called."""
        with self._lock:  # a restart under way finishes first; none starts after
            self._stopping = True
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _log_hint(self, name: str) -> str:
        if self.log_dir is None:
            return ""
        text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return ":\n" + text[-3000:]


def exit_reason(returncode: int) -> str:
    """'exited with code 1', 'was killed by SIGKILL'."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def envoy_in_front(environ: Mapping[str, str]) -> EnvoyConfig | None:
    """Envoy's settings when STORMSERVE_ENVOY turns it on (off by default), from the
    same environment (STORMSERVE_ENVOY_PORT and the rest; its upstream ports are the
    chain's); None when it is off."""
    switch = environ.get("STORMSERVE_ENVOY", "")
    if not switch.strip() or not parse_bool(switch):
        return None
    from services.envoy.config import EnvoyConfig

    return load_config(EnvoyConfig, argv=[], environ=environ)


def disaggregated_roles(spec: str, groups: int) -> list[str]:
    """Every worker's role for a spec such as 1P1D (per group, prefill first), in
    the order Chain deals workers to groups: worker i is of group i % groups."""
    match = re.fullmatch(r"(\d+)P(\d+)D", spec.strip().upper())
    if match is None or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"disaggregate must read like 1P1D (prefill and decode workers, at least one each), "
                         f"got {spec!r}")
    per_group = ["prefill"] * int(match[1]) + ["decode"] * int(match[2])
    return [per_group[i // groups] for i in range(len(per_group) * groups)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the stormserve chain locally.")
    parser.add_argument("--host", default=os.environ.get("STORMSERVE_HOST", "127.0.0.1"),
                        help="edge listen address (env STORMSERVE_HOST)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("STORMSERVE_PORT", "8000")),
                        help="edge port (env STORMSERVE_PORT)")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("STORMSERVE_WORKERS", "1")),
                        help="number of worker processes per serving group (env STORMSERVE_WORKERS)")
    parser.add_argument("--groups", type=int, default=int(os.environ.get("STORMSERVE_GROUPS", "1")),
                        help="number of serving groups, a scheduler and its workers each (env STORMSERVE_GROUPS)")
    parser.add_argument("--disaggregate", default=os.environ.get("STORMSERVE_DISAGGREGATE", ""),
                        help="prefill and decode workers per serving group, e.g. 1P1D, in place of --workers "
                             "(env STORMSERVE_DISAGGREGATE)")
    args = parser.parse_args()
    if args.workers < 1 or args.groups < 1:
        parser.error("--workers and --groups must be at least 1")
    roles: list[str] = []
    if args.disaggregate:
        try:
            roles = disaggregated_roles(args.disaggregate, args.groups)
        except ValueError as exc:
            parser.error(str(exc))
        args.workers = len(roles) // args.groups
    num_workers = args.workers * args.groups
    # gRPC ports: the first scheduler 50052, workers 50053 on, the other schedulers after them.
    # Metrics ports next to the edge's: tokenizer +1, scheduler +2, workers +3 on, the other
    # schedulers after them.
    worker_ports = [50053 + i for i in range(num_workers)]
    group_ports = [50053 + num_workers + g for g in range(args.groups - 1)]
    names = ["scheduler"] if args.groups == 1 else [f"scheduler{g}" for g in range(args.groups)]
    metrics_ports = {"tokenizer": args.port + 1, names[0]: args.port + 2,
                     **{f"worker{i}": args.port + 3 + i for i in range(num_workers)},
                     **{name: args.port + 3 + num_workers + g for g, name in enumerate(names[1:])}}
    chain = Chain(host=args.host, edge_port=args.port, worker_ports=worker_ports,
                  group_scheduler_ports=group_ports, metrics_ports=metrics_ports, worker_roles=roles,
                  envoy=envoy_in_front(os.environ))
    setup_logging("supervisor")
    supervising = False
    exit_code = 0

    def on_signal(signum, frame):
        if chain.stopping:
            return
        chain.request_stop()  # supervise() returns within a poll and restarts nothing more
        if not supervising:
            raise KeyboardInterrupt  # still starting: leave wait_ready now

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        chain.start()
        chain.wait_ready()
        print(f"stormserve is ready: {chain.url}/v1/chat/completions", flush=True)
        if chain.envoy_url is not None:
            print(f"  through Envoy: {chain.envoy_url}/v1/chat/completions (gRPC and "
                  f"{chain.envoy_url}/v1/grpc/chat as well)", flush=True)
        for name, url in chain.metrics_urls.items():
            print(f"  metrics of {name}: {url}", flush=True)
        supervising = True
        chain.supervise()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:  # a service failed to start
        print(f"stopping: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        chain.stop()
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
