"""python -m services.worker.follower: one follower rank of a tensor-parallel
worker (parallel.py). Rank 0 starts it with its own config as flags and the
group's addresses; it loads its shard of the model, then runs each step rank
0 sends until rank 0 closes the channel (or goes: SIGTERM).

In a group that spans pods (pods.py: LeaderWorkerSet's variables), it is also
what a follower pod runs, without --tp-rank: it runs the pod's first rank and
starts the pod's others; each meets rank 0 at the leader. A rank whose
channel closes without rank 0 ending the group exits with an error, and so
does the pod when one of its ranks exits: LeaderWorkerSet restarts the group."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time

from services.common.config import load_config
from services.common.log import setup_logging
from services.common.model_files import resolve_model
from services.common.supervisor import SUPERVISOR_PID_ENV, exit_reason, exit_with_supervisor
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.parallel import WATCH_POLL_S, TensorParallel, config_flags
from services.worker.platforms import Platform, select_platform
from services.worker.pods import PodGroup


def build_runner(config: WorkerConfig, platform: Platform, group: TensorParallel | None) -> ModelRunner:
    """The model runner of one rank (every rank: rank 0 in __main__, followers here)."""
    return ModelRunner(
        resolve_model(config.model_path),
        platform,
        dtype=platform.resolve_dtype(config.dtype),
        block_size=config.cache_block_size,
        kv_cache_bytes=config.kv_cache_mib * 2**20,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        tensor_parallel=group,
        mtp=config.speculative_method == "mtp",
        graph_capture=platform.graph_capture() if config.graphs == "auto" else None,
    )


def _start_pod_ranks(config: WorkerConfig, pods: PodGroup, log: logging.Logger) -> None:
    """A follower pod: start its ranks after the first (this process), and exit
    with an error when one of them exits (they get SIGTERM when this one goes)."""
    ranks = pods.ranks(config.tensor_parallel_size)
    env = {**os.environ, **pods.environ(), SUPERVISOR_PID_ENV: str(os.getpid())}
    processes = {rank: subprocess.Popen([sys.executable, "-m", "services.worker.follower", "--tp-rank", str(rank),
                                         *config_flags(config)], env=env) for rank in ranks[1:]}

    def watch() -> None:
        while True:
            for rank, process in processes.items():
                if process.poll() is not None:
                    log.critical("tensor-parallel rank %d %s: the tensor-parallel group cannot go on; exiting",
                                 rank, exit_reason(process.returncode))
                    logging.shutdown()
                    os._exit(1)
            time.sleep(WATCH_POLL_S)

    if processes:
        threading.Thread(target=watch, name="tp-watch", daemon=True).start()


def main() -> None:
    exit_with_supervisor()  # rank 0 (or a follower pod's first rank) is the supervisor here: SIGTERM when it goes
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp-rank", type=int, help="this rank (default: a follower pod's first)")
    parser.add_argument("--tp-listen", help="host:port this rank takes rank 0's steps on (one host)")
    parser.add_argument("--tp-dist-port", type=int, help="torch.distributed's rendezvous port (one host)")
    args, rest = parser.parse_known_args()
    config = load_config(WorkerConfig, argv=rest)
    world_size = config.tensor_parallel_size
    pods = None if args.tp_listen else PodGroup.from_env(os.environ, config.group_port)
    if args.tp_listen is None and (pods is None or (args.tp_rank is None and pods.is_leader)):
        raise SystemExit("a follower runs with --tp-listen (started by rank 0), or in a follower pod of a group "
                         "that spans pods (LWS_GROUP_SIZE > 1, LWS_WORKER_INDEX > 0)")
    rank = args.tp_rank if args.tp_rank is not None else pods.ranks(world_size)[0]
    log = setup_logging(f"worker-rank{rank}")
    if args.tp_rank is None:
        _start_pod_ranks(config, pods, log)
    local_ranks = pods.ranks_per_pod(world_size) if pods else world_size
    platform = select_platform(config.device, local_rank=rank % local_ranks)
    platform.set_num_threads(config.num_threads, local_ranks)
    platform.set_activations(config.activations)
    if pods is None:
        group = TensorParallel.join(rank, world_size, args.tp_listen, args.tp_dist_port, platform)
    else:
        group = TensorParallel.join_pods(rank, world_size, pods, platform)
    runner = build_runner(config, platform, group)
    log.info("rank %d of %d loaded; following rank 0", rank, world_size)
    for inputs, block_copies in group.steps():
        try:
            runner.follow(inputs, block_copies)
        except RuntimeError as exc:  # a collective whose peer is gone (torch.distributed's errors are these)
            log.critical("rank %d: a step failed (%s): the tensor-parallel group cannot go on; exiting", rank,
                         str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            log.debug("the failed step", exc_info=True)
            raise SystemExit(1) from None
    if not group.released:
        log.critical("rank %d lost rank 0 (its step channel closed): the tensor-parallel group cannot go on; "
                     "exiting", rank)
        raise SystemExit(1)
    log.info("rank 0 ended the group")


if __name__ == "__main__":
    main()
