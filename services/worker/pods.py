"""A tensor-parallel worker whose ranks span pods: a LeaderWorkerSet group.

LeaderWorkerSet (kubernetes-sigs/lws) starts a group of `size` pods, a leader
and `size - 1` workers, and gives every container of the group
LWS_LEADER_ADDRESS (the leader pod's DNS name), LWS_GROUP_SIZE (the pods in
the group) and LWS_WORKER_INDEX (0 on the leader, 1 to size - 1 on the
others). Those three variables are this mode's settings: where LWS_GROUP_SIZE
is above 1, the worker's `tensor_parallel_size` ranks split evenly over the
pods, and pod k runs the ranks k × ranks per pod to (k + 1) × ranks per pod - 1,
one process per device. Set by hand, the same variables make a group of
processes on one machine (the tests do).

Rank 0 runs on the leader pod and serves WorkerService (services.worker);
every other rank is a follower (services.worker.follower). They meet at the
leader on two ports: `group_port`, torch.distributed's TCP store (rank 0
hosts it), and `group_port + 1`, rank 0's step channel. Each follower reads
the channel's key from the store, connects, and says its rank; rank 0 sends
it every step as on one host (parallel.py). The key travels through the
store, so the group trusts its network as torch.distributed itself does (the
chart's NetworkPolicy lets only the release's workers reach these ports). A follower that loses rank 0
exits with an error; rank 0 that loses a follower exits (the scheduler ends
the group's sequences with its worker-lost error); either way a container
exits and LeaderWorkerSet, with RecreateGroupOnPodRestart, starts the whole
group again.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

import torch.distributed as dist

log = logging.getLogger(__name__)

GROUP_SIZE_ENV, WORKER_INDEX_ENV, LEADER_ADDRESS_ENV = "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"
# The step channel's key, which rank 0 puts in the store for the followers.
AUTHKEY_STORE_KEY = "stormserve/steps-authkey"
# How long the pods of a group wait for each other (images pull, models load).
GROUP_TIMEOUT = timedelta(minutes=10)
POLL_S = 0.2


@dataclass(frozen=True)
class PodGroup:
    """This pod's place in a group of pods that runs one worker."""

    size: int  # pods in the group
    index: int  # this pod's: 0 is the leader, which runs rank 0
    leader_address: str  # the leader pod's host name (or address)
    port: int  # the store's port on the leader; the step channel's is the next one

    @classmethod
    def from_env(cls, environ: Mapping[str, str], port: int) -> PodGroup | None:
        """The group LeaderWorkerSet's variables describe; None without them
        or for a group of one pod. ValueError for variables that do not fit."""
        size = environ.get(GROUP_SIZE_ENV, "")
        if size in ("", "1"):
            return None
        try:
            group = cls(int(size), int(environ.get(WORKER_INDEX_ENV, "")), environ.get(LEADER_ADDRESS_ENV, ""), port)
        except ValueError:
            raise ValueError(f"{GROUP_SIZE_ENV}={size!r} and {WORKER_INDEX_ENV}="
                             f"{environ.get(WORKER_INDEX_ENV)!r} must be whole numbers") from None
        if not 0 <= group.index < group.size:
            raise ValueError(f"{WORKER_INDEX_ENV} must be in [0, {group.size}), got {group.index}")
        if not group.leader_address:
            raise ValueError(f"{LEADER_ADDRESS_ENV} must name the group's leader pod")
        if not 0 < port < 65535:
            raise ValueError(f"group_port must be in [1, 65534] (the step channel takes the next), got {port}")
        return group

    def environ(self) -> dict[str, str]:
        """The variables that give this group back (to the ranks a pod starts)."""
        return {GROUP_SIZE_ENV: str(self.size), WORKER_INDEX_ENV: str(self.index),
                LEADER_ADDRESS_ENV: self.leader_address}

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    @property
    def steps_port(self) -> int:
        return self.port + 1

    def ranks_per_pod(self, world_size: int) -> int:
        if world_size % self.size:
            raise ValueError(f"tensor_parallel_size {world_size} does not split evenly over "
                             f"{self.size} pods ({GROUP_SIZE_ENV})")
        return world_size // self.size

    def ranks(self, world_size: int) -> range:
        """This pod's ranks: global rank = pod index × ranks per pod + local rank."""
        per_pod = self.ranks_per_pod(world_size)
        return range(self.index * per_pod, (self.index + 1) * per_pod)

    def leader_host(self) -> str:
        """Where this pod reaches rank 0: itself on the leader pod."""
        return "127.0.0.1" if self.is_leader else self.leader_address

    def open_store(self, rank: int, world_size: int) -> dist.TCPStore:
        """The group's rendezvous store: rank 0 hosts it, the others connect
        (waiting for the leader's name to resolve and the store to listen)."""
        if rank:
            _wait_resolvable(self.leader_host())
        return dist.TCPStore(self.leader_host(), self.port, world_size, is_master=rank == 0,
                             timeout=GROUP_TIMEOUT, wait_for_workers=False)

    def connect(self, rank: int, store: dist.Store) -> Connection:
        """A follower: its step channel from rank 0, the key read from the store."""
        authkey = bytes.fromhex(store.get(AUTHKEY_STORE_KEY).decode())
        connection = Client((self.leader_host(), self.steps_port), authkey=authkey)
        connection.send_bytes(str(rank).encode())
        return connection


def _wait_resolvable(host: str) -> None:
    """A pod's DNS name answers once the pod exists: wait for it."""
    deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the group's leader {host} did not resolve within {GROUP_TIMEOUT}") from None
            time.sleep(POLL_S)


def accept_followers(listener: Listener, ranks: range, failed: Callable[[], str | None]) -> dict[int, Connection]:
    """Rank 0: the step channel of each follower rank in `ranks`, as each
    connects with the key and says its rank. RuntimeError when `failed` names
    a reason (a local rank exited) or the group does not form in time."""
    connections: dict[int, Connection] = {}
    errors: list[Exception] = []

    def accept() -> None:
        while len(connections) < len(ranks):
            try:
                connection = listener.accept()
            except (AuthenticationError, OSError, EOFError) as exc:  # a peer without the key
                log.warning("refused a step-channel connection: %s", exc)
                continue
            try:
                rank = int(connection.recv_bytes(16))
            except (ValueError, OSError, EOFError):
                rank = -1
            if rank not in ranks or rank in connections:
                errors.append(RuntimeError(f"a follower said it was rank {rank}; expected one of {list(ranks)}"))
                return
            connections[rank] = connection

    thread = threading.Thread(target=accept, name="tp-accept", daemon=True)
    thread.start()
    deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
    while thread.is_alive():
        thread.join(POLL_S)
        reason = failed()
        if reason:
            raise RuntimeError(reason)
        if time.monotonic() > deadline:
            missing = sorted(set(ranks) - set(connections))
            raise RuntimeError(f"tensor-parallel ranks {missing} did not join within {GROUP_TIMEOUT}")
    if errors:
        raise errors[0]
    return dict(sorted(connections.items()))
