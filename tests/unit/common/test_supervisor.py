"""The supervisor's Chain: a service that dies is started again after a delay
that doubles with each crash up to a cap and starts over once the service
stayed up; a stop ends all that. A service goes when the supervisor goes,
even by SIGKILL.

The delays run on a fake clock: each test says when `heal` looks, so nothing
depends on how fast this machine starts a process."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common import supervisor
from services.common.supervisor import Chain, disaggregated_roles

SERVICE = """
import os, sys, time
from pathlib import Path
from services.common.supervisor import SUPERVISOR_PID_ENV, exit_with_supervisor
exit_with_supervisor()
Path(sys.argv[1]).write_text(f"{os.getpid()} {os.environ.get(SUPERVISOR_PID_ENV, '-')}")
time.sleep(120)
"""

SUPERVISOR = """
import sys, time
from services.common.supervisor import Chain
Chain()._spawn("service", "fake_service", sys.argv[1])
time.sleep(120)
"""


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # dead, waiting for whoever adopted it to reap it


def _wait_for(condition, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_service_gets_sigterm_when_its_supervisor_is_killed(tmp_path: Path):
    (tmp_path / "fake_service.py").write_text(SERVICE)
    ready = tmp_path / "ready"
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root / "gen"), str(root)])}
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(ready)], env=env)
    try:
        assert _wait_for(lambda: ready.exists() and ready.read_text(), 60), "the service never started"
        pid, inherited = ready.read_text().split()
        assert inherited == "-"  # taken out of the environment: its own children do not inherit it
        assert not _is_gone(int(pid))
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        assert _wait_for(lambda: _is_gone(int(pid)), 30), "the service outlived its supervisor"
    finally:
        supervisor.kill()
        supervisor.wait()


# A service that exits at once with the code it is given, or runs until killed.
TINY_SERVICE = """
import sys, time
from services.common.supervisor import exit_with_supervisor
exit_with_supervisor()
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
time.sleep(600)
"""


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def chain(tmp_path: Path):
    (tmp_path / "tiny_service.py").write_text(TINY_SERVICE)
    chain = Chain(env={"PYTHONPATH": str(tmp_path)}, log_dir=tmp_path / "logs", clock=FakeClock())
    yield chain
    chain.stop()


def kill(chain: Chain, name: str) -> int:
    proc = chain.procs[name]
    proc.kill()
    proc.wait()
    return proc.pid


def test_a_dead_service_restarts_after_a_delay_that_doubles_up_to_the_cap(chain, caplog):
    caplog.set_level(logging.WARNING, logger="stormserve.supervisor")
    chain._spawn("service", "tiny_service", "run")
    delays = []
    for restart in range(1, 8):
        old_pid = kill(chain, "service")
        assert chain.heal() == []  # found dead: its delay starts now
        died_at = chain.clock.now
        while not chain.heal():  # looks every 0.5 s until the service is started again
            chain.clock.now += 0.5
        delays.append(chain.clock.now - died_at)
        assert chain.procs["service"].pid != old_pid and chain.procs["service"].poll() is None
        assert chain.restarts["service"] == restart
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    found = [r.getMessage() for r in caplog.records if "restarting it in" in r.getMessage()]
    assert found[0] == "service was killed by SIGKILL after 0.0 s up; restarting it in 1 s"
    assert found[-1].endswith("restarting it in 30 s")
    log = (chain.log_dir / "service.log").read_text()
    assert log.count("--- service restarted by the supervisor ---") == 7


def test_the_delay_starts_over_once_the_service_stayed_up(chain):
    chain._spawn("service", "tiny_service", "run")

    def restart_delay() -> float:
        kill(chain, "service")
        chain.heal()
        died_at = chain.clock.now
        while not chain.heal():
            chain.clock.now += 0.5
        return chain.clock.now - died_at

    assert [restart_delay(), restart_delay(), restart_delay()] == [1, 2, 4]
    chain.clock.now += supervisor.STABLE_AFTER_S  # up for a minute: recovered
    assert restart_delay() == 1
    assert restart_delay() == 2  # and a new loop doubles again


def test_the_exit_code_is_logged_and_each_service_has_its_own_delay(chain, caplog):
    caplog.set_level(logging.WARNING, logger="stormserve.supervisor")
    chain._spawn("crashing", "tiny_service", "exit", "3")
    chain._spawn("steady", "tiny_service", "run")
    chain.procs["crashing"].wait()
    assert chain.heal() == []
    assert "crashing exited with code 3 after" in caplog.text
    chain.clock.now += 1
    assert chain.heal() == ["crashing"]  # the steady one is left alone
    chain.procs["crashing"].wait()
    chain.heal()
    kill(chain, "steady")
    chain.heal()
    chain.clock.now += 1
    assert chain.heal() == ["steady"]  # its first crash: 1 s, while the other waits 2 s
    chain.clock.now += 1
    assert chain.heal() == ["crashing"]


def test_nothing_restarts_after_stop(chain):
    chain._spawn("service", "tiny_service", "run")
    kill(chain, "service")
    chain.heal()
    chain.stop()
    chain.clock.now += 100
    assert chain.heal() == []
    assert chain.procs["service"].poll() is not None
    chain.supervise(poll_s=0)  # returns at once: the chain is stopping


def test_supervise_heals_in_a_thread_and_stop_ends_it_with_every_service_stopped(tmp_path: Path):
    """As `make run` runs it (there on the main thread), on the real clock."""
    (tmp_path / "tiny_service.py").write_text(TINY_SERVICE)
    chain = Chain(env={"PYTHONPATH": str(tmp_path)}, log_dir=tmp_path / "logs")
    chain._spawn("service", "tiny_service", "run")
    loop = threading.Thread(target=chain.supervise, kwargs={"poll_s": 0.05}, daemon=True)
    loop.start()
    try:
        first = kill(chain, "service")
        assert _wait_for(lambda: chain.procs["service"].pid != first, 120), "the service was not restarted"
    finally:
        chain.stop()
    loop.join(60)
    assert not loop.is_alive()
    assert chain.procs["service"].poll() is not None


def test_a_stop_during_a_restart_waits_for_it_and_stops_the_new_process(chain, monkeypatch):
    chain._spawn("service", "tiny_service", "run")
    kill(chain, "service")
    chain.heal()
    chain.clock.now += 1
    restarting, go = threading.Event(), threading.Event()
    spawn = chain._spawn

    def slow_spawn(*args):
        restarting.set()
        go.wait(60)
        spawn(*args)

    monkeypatch.setattr(chain, "_spawn", slow_spawn)
    healer = threading.Thread(target=chain.heal)
    healer.start()
    assert restarting.wait(60)
    stopper = threading.Thread(target=chain.stop)
    stopper.start()
    time.sleep(0.2)  # lets stop() get as far as it can while the restart is under way
    go.set()
    healer.join(60)
    stopper.join(60)
    assert not healer.is_alive() and not stopper.is_alive()
    assert chain.procs["service"].poll() is not None  # the process the restart started was stopped too
    assert chain.heal() == []


@pytest.mark.parametrize("value", [None, "", "0", "off", "false", "No"])
def test_envoy_stays_out_unless_turned_on(value):
    environ = {"STORMSERVE_ENVOY_PORT": "9099"} | ({} if value is None else {"STORMSERVE_ENVOY": value})
    assert supervisor.envoy_in_front(environ) is None


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_envoy_in_front_takes_its_settings_from_the_environment(value):
    envoy = supervisor.envoy_in_front({"STORMSERVE_ENVOY": value, "STORMSERVE_ENVOY_PORT": "9099",
                                       "STORMSERVE_MAX_REQUEST_MIB": "3"})
    assert (envoy.envoy_port, envoy.max_request_mib) == (9099, 3)
    assert supervisor.envoy_in_front({"STORMSERVE_ENVOY": "1"}).envoy_port == 8080


def test_a_misspelt_envoy_switch_is_an_error_not_off():
    with pytest.raises(ValueError, match="not a boolean"):
        supervisor.envoy_in_front({"STORMSERVE_ENVOY": "yess"})


def _worker_commands(chain: Chain, monkeypatch) -> list[tuple[str, ...]]:
    spawned = {}
    monkeypatch.setattr(chain, "_spawn", lambda name, module, *args: spawned.setdefault(name, args))
    chain.start()
    return [args for name, args in spawned.items() if name.startswith("worker")]


def test_workers_on_one_host_share_its_cores_unless_the_operator_says(monkeypatch):
    monkeypatch.delenv("STORMSERVE_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    alone, = _worker_commands(Chain(metrics=False), monkeypatch)
    assert "--num-threads" not in alone  # one worker: torch's own default
    three = _worker_commands(Chain(worker_ports=[1, 2, 3], metrics=False), monkeypatch)
    assert [args[args.index("--num-threads") + 1] for args in three] == ["2", "2", "2"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert all(args[args.index("--num-threads") + 1] == "1"
               for args in _worker_commands(Chain(worker_ports=[1, 2], metrics=False), monkeypatch))
    chain = Chain(worker_ports=[1, 2], metrics=False, env={"STORMSERVE_NUM_THREADS": "4"})
    assert all("--num-threads" not in args for args in _worker_commands(chain, monkeypatch))
    monkeypatch.setenv("STORMSERVE_NUM_THREADS", "3")
    assert all("--num-threads" not in args
               for args in _worker_commands(Chain(worker_ports=[1, 2], metrics=False), monkeypatch))


def _flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


def test_serving_groups_each_get_a_scheduler_and_their_own_workers(monkeypatch):
    spawned = {}
    chain = Chain(scheduler_port=10, group_scheduler_ports=[11], worker_ports=[1, 2, 3, 4], metrics=False)
    monkeypatch.setattr(chain, "_spawn", lambda name, module, *args: spawned.setdefault(name, (module, *args)))
    chain.start()
    assert chain.scheduler_names == ["scheduler0", "scheduler1"]
    assert _flag(spawned["scheduler0"], "--port") == "10"
    assert _flag(spawned["scheduler0"], "--worker-addresses") == "127.0.0.1:1,127.0.0.1:3"
    assert _flag(spawned["scheduler1"], "--worker-addresses") == "127.0.0.1:2,127.0.0.1:4"
    assert _flag(spawned["tokenizer"], "--scheduler-addresses") == "127.0.0.1:10,127.0.0.1:11"
    # Each group's scheduler and workers label their metrics with its index.
    assert [_flag(spawned[name], "--serving-group") for name in ("scheduler0", "scheduler1")] == ["0", "1"]
    assert [_flag(spawned[f"worker{i}"], "--serving-group") for i in range(4)] == ["0", "1", "0", "1"]
    with pytest.raises(ValueError, match="at least as many workers"):
        Chain(group_scheduler_ports=[11], worker_ports=[1], metrics=False).start()


def test_one_group_is_started_as_before(monkeypatch):
    spawned = {}
    chain = Chain(scheduler_port=10, worker_ports=[1, 2], metrics=False)
    monkeypatch.setattr(chain, "_spawn", lambda name, module, *args: spawned.setdefault(name, (module, *args)))
    chain.start()
    assert chain.scheduler_names == ["scheduler"] and "scheduler0" not in spawned
    assert all("--serving-group" not in args for args in spawned.values())  # the setting's default, "0"
    assert _flag(spawned["scheduler"], "--worker-addresses") == "127.0.0.1:1,127.0.0.1:2"
    assert _flag(spawned["tokenizer"], "--scheduler-address") == "127.0.0.1:10"


def test_disaggregated_groups_each_get_their_prefill_and_decode_workers(monkeypatch):
    roles = disaggregated_roles("1p2d", groups=2)
    spawned = {}
    chain = Chain(scheduler_port=10, group_scheduler_ports=[11], worker_ports=[1, 2, 3, 4, 5, 6],
                  worker_roles=roles, metrics=False)
    monkeypatch.setattr(chain, "_spawn", lambda name, module, *args: spawned.setdefault(name, (module, *args)))
    chain.start()
    for group in (0, 1):
        workers = [f"worker{i}" for i in chain.group_workers(group)]
        assert sorted(_flag(spawned[w], "--role") for w in workers) == ["decode", "decode", "prefill"]
    for spec in ("2P", "0P1D", "1P0D", "PD"):
        with pytest.raises(ValueError, match="like 1P1D"):
            disaggregated_roles(spec, groups=1)


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    import socket as socket_module

    from services.common import supervisor

    ports = iter([41001, 41002, 41001, 41002, 41003])  # the kernel giving released ports out again

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(ports)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(supervisor, "_handed_out", set())
    monkeypatch.setattr(socket_module, "socket", Socket)
    assert [supervisor.free_port() for _ in range(3)] == [41001, 41002, 41003]
