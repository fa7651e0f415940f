"""python -m services.worker.follower: one follower rank of a tensor-parallel
worker (parallel.py). Rank 0 starts it with its own config as flags and the
group's addresses; it loads its shard of the model, then runs each step rank
0 sends until rank 0 closes the channel (or goes: SIGTERM)."""
from __future__ import annotations

import argparse

from services.common.config import load_config
from services.common.log import setup_logging
from services.common.model_files import resolve_model
from services.common.supervisor import exit_with_supervisor
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.parallel import TensorParallel
from services.worker.platforms import Platform, select_platform


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


def main() -> None:
    exit_with_supervisor()  # rank 0 is the supervisor here: SIGTERM when it goes
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--tp-listen", required=True, help="host:port this rank takes rank 0's steps on")
    parser.add_argument("--tp-dist-port", type=int, required=True, help="torch.distributed's rendezvous port")
    args, rest = parser.parse_known_args()
    config = load_config(WorkerConfig, argv=rest)
    log = setup_logging(f"worker-rank{args.tp_rank}")
    platform = select_platform(config.device, local_rank=args.tp_rank)
    platform.set_num_threads(config.num_threads, config.tensor_parallel_size)
    platform.set_activations(config.activations)
    group = TensorParallel.join(args.tp_rank, config.tensor_parallel_size, args.tp_listen, args.tp_dist_port,
                                platform)
    runner = build_runner(config, platform, group)
    log.info("rank %d of %d loaded; following rank 0", args.tp_rank, config.tensor_parallel_size)
    for inputs, block_copies in group.steps():
        runner.follow(inputs, block_copies)
    log.info("rank 0 closed the step channel")


if __name__ == "__main__":
    main()
