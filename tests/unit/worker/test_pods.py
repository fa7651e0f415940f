"""A tensor-parallel worker whose ranks span pods (services/worker/pods.py),
on loopback: two "pods" are processes started with LeaderWorkerSet's
variables (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE=2, LWS_WORKER_INDEX=0 and 1),
one CPU rank each over gloo (and two each, on a tiny model, for the global
ranks). Their greedy tokens are one process's; a killed
follower pod takes the leader down with it (the scheduler then ends the
group's sequences with its worker-lost error), and a killed leader makes the
follower pod exit with an error (LeaderWorkerSet then restarts the group)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from services.common.config import load_config
from services.common.supervisor import free_port
from services.worker.config import WorkerConfig
from services.worker.follower import build_runner
from services.worker.model_runner import ModelRunner
from services.worker.parallel import TensorParallel
from services.worker.platforms import select_platform
from services.worker.pods import PodGroup
from services.worker.sequence import SamplingParams
from tests.unit.worker.block_tables import BlockTables

# The group's settings, as the chart passes them to both pods.
SETTINGS = {"STORMSERVE_DEVICE": "cpu", "STORMSERVE_DTYPE": "float32", "STORMSERVE_CACHE_BLOCK_SIZE": "4",
            "STORMSERVE_KV_CACHE_MIB": "16", "STORMSERVE_MAX_BATCH_SIZE": "8",
            "STORMSERVE_TENSOR_PARALLEL_SIZE": "2", "STORMSERVE_NUM_THREADS": "1"}
# Long enough for both processes to import torch and load the model on a busy 2-core machine.
PROCESS_TIMEOUT_S = 240


def _pod_env(index: int, group_port: int) -> dict[str, str]:
    return {**os.environ, **SETTINGS, "STORMSERVE_GROUP_PORT": str(group_port), "LWS_LEADER_ADDRESS": "127.0.0.1",
            "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index), "PYTHONPATH": os.pathsep.join(sys.path)}


def _follower_pod(group_port: int, log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "services.worker.follower"], env=_pod_env(1, group_port),
                                stdout=out, stderr=subprocess.STDOUT)


def test_the_group_comes_from_leaderworkersets_variables():
    env = {"LWS_LEADER_ADDRESS": "llm-worker-0.llm-worker.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    pods = PodGroup.from_env(env, 29500)
    assert (pods.size, pods.index, pods.is_leader, pods.steps_port) == (2, 1, False, 29501)
    assert list(pods.ranks(16)) == list(range(8, 16))  # worker index × devices per pod + local rank
    assert pods.leader_host() == "llm-worker-0.llm-worker.ns"
    assert PodGroup.from_env({**env, "LWS_WORKER_INDEX": "0"}, 29500).leader_host() == "127.0.0.1"
    assert PodGroup.from_env({}, 29500) is None
    assert PodGroup.from_env({**env, "LWS_GROUP_SIZE": "1"}, 29500) is None  # one pod: a worker as before
    with pytest.raises(ValueError, match="does not split evenly over 2 pods"):
        pods.ranks(3)
    with pytest.raises(ValueError, match=r"LWS_WORKER_INDEX must be in \[0, 2\)"):
        PodGroup.from_env({**env, "LWS_WORKER_INDEX": "2"}, 29500)


@contextmanager
def _leader_in_process(model_dir: Path, tmp_path: Path) -> Iterator[tuple[ModelRunner, subprocess.Popen]]:
    """Rank 0 here, as the leader pod runs it; the follower pod a real process."""
    group_port = free_port()
    follower = _follower_pod(group_port, tmp_path / "follower.log")
    config = load_config(WorkerConfig, environ={**SETTINGS, "STORMSERVE_GROUP_PORT": str(group_port)},
                         argv=["--model-path", str(model_dir)])
    platform = select_platform("cpu")
    try:
        group = TensorParallel.start(config, platform, PodGroup(2, 0, "127.0.0.1", group_port))
        try:
            yield build_runner(config, platform, group), follower
        finally:
            group.close()
    finally:
        if follower.poll() is None:
            follower.wait(PROCESS_TIMEOUT_S)


def _greedy(runner: ModelRunner, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt prefilled (together), then `num_tokens` greedy decode steps of all."""
    tables, greedy = BlockTables(runner), SamplingParams(temperature=0.0)
    step = [tables.feed(i, prompt, 0, True, greedy) for i, prompt in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    for _ in range(num_tokens):
        for i, token in enumerate(runner.step(step).tokens):
            outputs[i].append(token.token_id)
        step = [tables.feed(i, [outputs[i][-1]], lengths[i] + len(outputs[i]) - 1, True)
                for i in range(len(prompts))]
    runner.step([], release_seq_ids=list(range(len(prompts))))
    return outputs


def test_two_pods_give_one_processs_greedy_text(runner, model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                              add_generation_prompt=True))
               for text in ("Name three colours of the rainbow.", "Write one sentence about the sea.")]
    with _leader_in_process(model_dir, tmp_path) as (group_runner, follower):
        together = _greedy(group_runner, prompts, 12)
    assert follower.returncode == 0, (tmp_path / "follower.log").read_text()  # ended by rank 0, not lost
    alone = _greedy(runner, prompts, 12)
    assert [tokenizer.decode(t) for t in together] == [tokenizer.decode(t) for t in alone]
    assert together == alone


def _wait_for_line(process: subprocess.Popen, log: Path, text: str) -> None:
    """Until `text` is in the process's log; fails if the process exits first."""
    while text not in log.read_text():
        try:
            process.wait(0.5)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"exited ({process.returncode}) before logging {text!r}:\n{log.read_text()}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama: the kill tests time the group, not the model."""
    from transformers import LlamaConfig

    from tests.unit.worker.test_tensor_parallel import SMALL, _tiny_model

    return _tiny_model(LlamaConfig(**SMALL), tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("killed", ["follower", "leader"])
def test_a_killed_pod_ends_the_group(killed, tiny_model, tmp_path, monkeypatch):
    """Both pods real processes: the leader serving WorkerService, the
    follower pod following it. SIGKILL one; the other exits with an error
    that names what it lost."""
    monkeypatch.setenv("STORMSERVE_MODEL_PATH", str(tiny_model))  # both pods' environment starts from os.environ
    group_port = free_port()
    leader_log = tmp_path / "leader.log"
    with leader_log.open("wb") as out:
        leader = subprocess.Popen([sys.executable, "-m", "services.worker", "--port", "0"],
                                  env=_pod_env(0, group_port), stdout=out, stderr=subprocess.STDOUT)
    follower = _follower_pod(group_port, tmp_path / "follower.log")
    pods = {"leader": (leader, leader_log), "follower": (follower, tmp_path / "follower.log")}
    try:
        # Both idle: rank 0 serves, the follower waits for a step.
        _wait_for_line(leader, leader_log, "serving on port")
        _wait_for_line(follower, tmp_path / "follower.log", "following rank 0")
        pods[killed][0].send_signal(signal.SIGKILL)
        (survivor, log), = [pod for name, pod in pods.items() if name != killed]
        assert survivor.wait(PROCESS_TIMEOUT_S) == 1, log.read_text()
        expected = "tensor-parallel rank 1 closed its step channel" if killed == "follower" else "lost rank 0"
        assert expected in log.read_text()
        assert "the tensor-parallel group cannot go on; exiting" in log.read_text()
    finally:
        for process, _ in pods.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_two_pods_of_two_ranks_give_one_processs_logprobs(tmp_path):
    """Four ranks, two per pod: rank 0 starts rank 1 beside it, the follower
    pod runs rank 2 and starts rank 3 (global rank = pod index × 2 + local
    rank); a tiny random model with 4 KV heads, one per rank."""
    from transformers import LlamaConfig

    from tests.unit.worker.test_tensor_parallel import SMALL, VOCAB, _assert_same_logprobs, _logprobs, _tiny_model

    model_path = _tiny_model(LlamaConfig(**{**SMALL, "num_attention_heads": 8, "num_key_value_heads": 4}), tmp_path)
    sequences = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1)).tolist()
    alone = ModelRunner(model_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=16 * 2**20,
                        max_batch_size=8)
    group_port = free_port()
    settings = {**SETTINGS, "STORMSERVE_TENSOR_PARALLEL_SIZE": "4", "STORMSERVE_MODEL_PATH": str(model_path)}
    with (tmp_path / "follower.log").open("wb") as out:
        follower = subprocess.Popen([sys.executable, "-m", "services.worker.follower"],
                                    env={**_pod_env(1, group_port), **settings}, stdout=out, stderr=subprocess.STDOUT)
    try:
        config = load_config(WorkerConfig, environ={**settings, "STORMSERVE_GROUP_PORT": str(group_port)}, argv=[])
        platform = select_platform("cpu")
        group = TensorParallel.start(config, platform, PodGroup(2, 0, "127.0.0.1", group_port))
        try:
            group_runner = build_runner(config, platform, group)
            assert group_runner.kv_pool.spec.num_kv_heads == 1
            together = _logprobs(group_runner, sequences, VOCAB)
        finally:
            group.close()
        assert follower.wait(PROCESS_TIMEOUT_S) == 0, (tmp_path / "follower.log").read_text()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert "rank 2 of 4 loaded" in (tmp_path / "follower.log").read_text()
    _assert_same_logprobs(together, _logprobs(alone, sequences, VOCAB), VOCAB)
