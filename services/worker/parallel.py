"""Tensor parallelism: one worker as a group of ranks, one process per device.

Rank 0 is the worker the scheduler sees: it serves WorkerService, validates
each step, sends it to the other ranks (the followers, services/worker/follower.py)
and samples once the step's logits are gathered. Every rank runs the same
forward on its shard of the model, in lockstep:

- Q/K/V and gate/up are column-parallel (each rank computes its heads and its
  slice of the MLP), o_proj and down row-parallel with one all-reduce each
  (rank 0 adds the residual, so the sum holds it once);
- KV heads, and so the KV pool, are split by KV-head groups: a rank holds
  whole groups (its KV heads and the query heads that read them), as evenly as
  the group count allows (the bundled model's 3 groups on 2 ranks: 2 and 1);
- the embedding and lm_head are vocabulary-parallel: each rank holds a slice
  of the rows (zero-padded to equal slices); lookups outside it give zeros and
  one all-reduce completes the hidden states; one all-gather the logits.

The lean Llama-family decoder reads its shard through ShardedWeights; any
other HF model whose tensors follow the same names (q/k/v/o_proj,
gate/up/down_proj, embed_tokens, lm_head, norms) runs its own modules with
their parameters swapped for the same shards (TensorParallel.shard_module).
A model with a tensor outside those rules is refused at start.

Steps travel over a plain socket per follower (multiprocessing.connection),
not a torch.distributed broadcast: a follower waits for the next step as long
as the worker is idle, which a collective's timeout would not allow. Tensors
move by torch.distributed on the platform's backend (gloo, NCCL, HCCL).

A rank that dies ends the group: rank 0 exits (a watcher sees the process go;
a collective with a dead peer fails the step first where the backend notices),
the scheduler fails the sequences it ran with its worker-lost error, and the
supervisor (or Kubernetes) starts the group again. Followers get SIGTERM when
rank 0 goes. On one host rank 0 starts every rank; a group may also span pods
(pods.py: LeaderWorkerSet), each pod starting its own ranks, whose step
channels rank 0 accepts over the network.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from services.common.supervisor import SUPERVISOR_PID_ENV, exit_reason, free_port
from services.worker.platforms import Platform
from services.worker.pods import AUTHKEY_STORE_KEY, PodGroup, accept_followers
from services.worker.quantization import GROUP, Fp8BlockWeight, Int8Weight, QuantizedWeight
from services.worker.sequence import SequenceInput

log = logging.getLogger(__name__)

# How often rank 0 looks for a follower that exited.
WATCH_POLL_S = 0.2
# How long a follower may take to start listening (it imports torch first).
JOIN_TIMEOUT_S = 300.0
# The step channel's key, handed to the followers out of their command lines.
AUTHKEY_ENV = "STORMSERVE_TP_AUTHKEY"


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of one rank: whole KV-head groups."""

    first_kv_head: int
    num_kv_heads: int
    first_head: int
    num_heads: int


def balanced_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items split into `parts` parts
    as evenly as possible (the first ones one larger)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def _connect(address: tuple[str, int], authkey: bytes, process: subprocess.Popen) -> Connection:
    """Rank 0's end of a follower's step channel, once the follower listens;
    RuntimeError if it exits or takes too long first."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if process.poll() is not None:
                raise RuntimeError(f"a tensor-parallel rank {exit_reason(process.returncode)} while starting") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"a tensor-parallel rank did not listen within {JOIN_TIMEOUT_S:.0f} s") from None
            time.sleep(WATCH_POLL_S)


def config_flags(config) -> list[str]:
    """A config dataclass as the flags that give it back (load_config)."""
    return [item for f in dataclasses.fields(config)
            for item in (f"--{f.name.replace('_', '-')}", str(getattr(config, f.name)))]


class TensorParallel:
    """This rank's place in the group, its shards, and the group's collectives."""

    def __init__(self, rank: int, world_size: int, platform: Platform, dist_port: int = 0,
                 store: dist.Store | None = None):
        self.rank, self.world_size = rank, world_size
        self.platform = platform
        # One host: a rendezvous on a free local port; pods: the group's store (pods.py).
        rendezvous = {"store": store} if store is not None else {"init_method": f"tcp://127.0.0.1:{dist_port}"}
        dist.init_process_group(backend=platform.dist_backend, rank=rank, world_size=world_size,
                                timeout=timedelta(minutes=10), **rendezvous)
        self._followers: list[Connection] = []  # rank 0: one per follower, by rank
        self._processes: list[subprocess.Popen] = []  # rank 0: the followers it started
        self._leader: Connection | None = None  # a follower: its connection to rank 0
        self.released = False  # a follower: rank 0 ended the group (not lost)
        self._closing = False  # rank 0: close() is under way, followers leave

    # --- starting the group ---------------------------------------------------

    @classmethod
    def start(cls, config, platform: Platform, pods: PodGroup | None = None) -> TensorParallel:
        """Rank 0: start the followers with `config`, connect to each, join them;
        with `pods`, start this pod's followers and accept every follower's channel."""
        if pods is not None:
            return cls._start_pods(config, platform, pods)
        world_size = config.tensor_parallel_size
        authkey = secrets.token_bytes(16)
        dist_port = free_port()
        env = {**os.environ, SUPERVISOR_PID_ENV: str(os.getpid()), AUTHKEY_ENV: authkey.hex()}
        addresses = [("127.0.0.1", free_port()) for _ in range(1, world_size)]
        processes = [
            subprocess.Popen([sys.executable, "-m", "services.worker.follower", "--tp-rank", str(rank),
                              "--tp-listen", f"{host}:{port}", "--tp-dist-port", str(dist_port),
                              *config_flags(config)], env=env)
            for rank, (host, port) in enumerate(addresses, start=1)
        ]
        try:
            followers = [_connect(address, authkey, process) for address, process in zip(addresses, processes)]
        except RuntimeError:
            for process in processes:
                process.kill()
            raise
        group = cls(0, world_size, platform, dist_port)
        group._followers, group._processes = followers, processes
        threading.Thread(target=group._watch, name="tp-watch", daemon=True).start()
        log.info("tensor-parallel group of %d ranks (%s)", world_size, platform.dist_backend)
        return group

    @classmethod
    def _start_pods(cls, config, platform: Platform, pods: PodGroup) -> TensorParallel:
        world_size = config.tensor_parallel_size
        store = pods.open_store(0, world_size)
        authkey = secrets.token_bytes(16)
        listener = Listener((config.host, pods.steps_port), backlog=world_size, authkey=authkey)
        store.set(AUTHKEY_STORE_KEY, authkey.hex())
        env = {**os.environ, **pods.environ(), SUPERVISOR_PID_ENV: str(os.getpid())}
        processes = [subprocess.Popen([sys.executable, "-m", "services.worker.follower", "--tp-rank", str(rank),
                                       *config_flags(config)], env=env)
                     for rank in pods.ranks(world_size)[1:]]

        def failed() -> str | None:
            exited = [p.returncode for p in processes if p.poll() is not None]
            return f"a tensor-parallel rank {exit_reason(exited[0])} while starting" if exited else None

        try:
            with listener:
                followers = accept_followers(listener, range(1, world_size), failed)
        except RuntimeError:
            for process in processes:
                process.kill()
            raise
        group = cls(0, world_size, platform, store=store)
        group._followers, group._processes = list(followers.values()), processes
        threading.Thread(target=group._watch, name="tp-watch", daemon=True).start()
        log.info("tensor-parallel group of %d ranks over %d pods (%s)", world_size, pods.size,
                 platform.dist_backend)
        return group

    @classmethod
    def join_pods(cls, rank: int, world_size: int, pods: PodGroup, platform: Platform) -> TensorParallel:
        """A follower of a group that spans pods: meet rank 0 at the leader."""
        store = pods.open_store(rank, world_size)
        connection = pods.connect(rank, store)
        group = cls(rank, world_size, platform, store=store)
        group._leader = connection
        return group

    @classmethod
    def join(cls, rank: int, world_size: int, listen: str, dist_port: int, platform: Platform) -> TensorParallel:
        """A follower: wait for rank 0 to connect, join the group."""
        host, port = listen.rsplit(":", 1)
        with Listener((host, int(port)), authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV))) as listener:
            connection = listener.accept()
        group = cls(rank, world_size, platform, dist_port)
        group._leader = connection
        return group

    def _watch(self) -> None:
        while True:
            for rank, process in enumerate(self._processes, start=1):
                if process.poll() is not None and not self._closing:
                    self.lost(f"tensor-parallel rank {rank} {exit_reason(process.returncode)}")
            # Followers never send: a channel that reads is one whose follower
            # is gone (how rank 0 sees a rank in another pod go).
            for rank, connection in enumerate(self._followers, start=1):
                try:
                    gone = connection.poll()
                except (OSError, ValueError):  # closed here: close() is under way
                    return
                if gone and not self._closing:
                    self.lost(f"tensor-parallel rank {rank} closed its step channel")
            time.sleep(WATCH_POLL_S)

    def lost(self, reason: str) -> None:
        """The group cannot run another step: rank 0 goes, so its sequences fail
        as a lost worker's do and the group is started again."""
        log.critical("%s: the tensor-parallel group cannot go on; exiting", reason)
        logging.shutdown()
        os._exit(1)

    def close(self) -> None:
        """Rank 0: end the followers (an empty step, then their step channel
        closes) and leave the group."""
        self._closing = True
        self._processes, processes = [], self._processes  # the watcher stops looking
        followers, self._followers = self._followers, []
        for connection in followers:
            try:
                connection.send_bytes(b"")
            except OSError:
                pass
            connection.close()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        dist.destroy_process_group()

    # --- steps ----------------------------------------------------------------

    def lead(self, inputs: list[SequenceInput], block_copies: Sequence[tuple[int, int]]) -> None:
        """Rank 0: send a validated step to every follower."""
        # Followers run the forward only: they need no sampling settings.
        payload = pickle.dumps(([dataclasses.replace(s, sampling=None) for s in inputs], list(block_copies)))
        for rank, connection in enumerate(self._followers, start=1):
            try:
                connection.send_bytes(payload)
            except OSError as exc:
                self.lost(f"tensor-parallel rank {rank} is unreachable ({exc})")

    def steps(self) -> Iterator[tuple[list[SequenceInput], list[tuple[int, int]]]]:
        """A follower: each step rank 0 sends, until it closes the channel."""
        assert self._leader is not None
        while True:
            try:
                payload = self._leader.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if not payload:
                self.released = True
                return
            yield pickle.loads(payload)

    # --- shards ---------------------------------------------------------------

    def head_shard(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        if num_kv_heads < self.world_size:
            raise ValueError(f"tensor parallelism splits KV heads: {num_kv_heads} cannot go to "
                             f"{self.world_size} ranks")
        first, end = balanced_range(num_kv_heads, self.world_size, self.rank)
        group = num_heads // num_kv_heads
        return HeadShard(first, end - first, first * group, (end - first) * group)

    def rows(self, total: int) -> tuple[int, int]:
        """This rank's slice of a column-parallel dimension (the MLP's)."""
        return balanced_range(total, self.world_size, self.rank)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the vocabulary, equal slices (the last padded)."""
        per_rank = -(-vocab_size // self.world_size)
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def shard_weights(self, weights: Mapping[str, torch.Tensor], config) -> ShardedWeights:
        return ShardedWeights(weights, self, config)

    def shard_module(self, model: torch.nn.Module, config) -> None:
        """An HF model's own modules made this rank's shard, in place: every
        parameter replaced by its ShardedWeights slice (the lean path's split),
        an all-reduce after each row-parallel projection, the embedding and
        lm_head vocabulary-parallel. Attention modules that size their heads
        from the projections' outputs (transformers' Llama-style ones) then
        run this rank's heads. ValueError, before anything changes, for a
        parameter ShardedWeights has no rule for."""
        parameters = dict(model.named_parameters())  # a tied lm_head is the embedding's parameter
        weights = ShardedWeights(parameters, self, config)
        shards = {name: weights.get(name) for name in parameters}
        for name, shard in shards.items():
            module_name, _, attribute = name.rpartition(".")
            if shard is None:  # a bias rank 0 alone adds
                setattr(model.get_submodule(module_name), attribute, None)
            else:
                parameters[name].data = shard
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in ROW_PARALLEL:
                module.register_forward_hook(lambda _module, _args, partial: self.all_reduce(partial))
        model.set_input_embeddings(_VocabParallelEmbedding(model.get_input_embeddings(), self))
        model.get_output_embeddings().register_forward_hook(
            lambda _module, _args, logits: self.gather_vocab(logits, config.vocab_size))

    # --- collectives ----------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def row_parallel(self, linear):
        """A row-parallel linear: partial products summed over the ranks, the
        residual (fused into rank 0's matmul where the platform can) added once."""
        first = self.rank == 0

        def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            return self.all_reduce(linear(x, residual if first else None))

        return forward

    def embed(self, lookup: Callable[[torch.Tensor], torch.Tensor], num_rows: int,
              input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: `lookup` of this rank's `num_rows` rows
        (a table's, or an HF embedding module's), zeros elsewhere, summed."""
        local = input_ids - self.rank * num_rows
        mine = (local >= 0) & (local < num_rows)
        x = lookup(local.clamp(0, num_rows - 1))
        return self.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's slice of the logits, side by side, padding dropped."""
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.platform.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


# Row-parallel projections: their outputs are partial sums, one all-reduce each.
ROW_PARALLEL = ("o_proj", "down_proj")


class ShardedWeights(Mapping):
    """A checkpoint's tensors as this rank holds them (see the module doc).
    ValueError for a tensor it has no rule for, or whose split dimension is
    not the size the config gives: a model that does not follow the Llama
    layout is refused, never split wrongly."""

    def __init__(self, weights: Mapping[str, torch.Tensor], group: TensorParallel, config):
        self._weights, self._group = weights, group
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self._hidden_size = config.hidden_size
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        intermediate_size = getattr(config, "intermediate_size", None) or 0  # 0: no gate/up/down MLP
        self._sizes = {"q": num_heads * self._head_dim, "kv": num_kv_heads * self._head_dim,
                       "mlp": intermediate_size, "vocab": config.vocab_size}
        self.heads = group.head_shard(num_heads, num_kv_heads)
        self.mlp_rows = group.rows(intermediate_size)
        self.vocab_rows = group.vocab_rows(config.vocab_size)

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name) -> bool:
        return name in self._weights and self._shard(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self._shard(name)
        if shard is None:
            raise KeyError(name)
        return shard

    def _split(self, module: str) -> tuple[int, tuple[int, int], str] | None:
        """How a projection's weight is split: (its dimension split, this rank's
        [start, end) of it, the config size it must have), or None for another module.
        Column-parallel ones split their output rows, row-parallel ones their inputs."""
        heads, dim = self.heads, self._head_dim
        q_rows = (heads.first_head * dim, (heads.first_head + heads.num_heads) * dim)
        if module == "q_proj":
            return 0, q_rows, "q"
        if module in ("k_proj", "v_proj"):
            return 0, (heads.first_kv_head * dim, (heads.first_kv_head + heads.num_kv_heads) * dim), "kv"
        if module in ("gate_proj", "up_proj"):
            return 0, self.mlp_rows, "mlp"
        if module == "o_proj":
            return 1, q_rows, "q"
        if module == "down_proj":
            return 1, self.mlp_rows, "mlp"
        return None

    def _shard(self, name: str) -> torch.Tensor | None:
        tensor = self._weights[name]
        module, kind = name.rsplit(".", 2)[-2:]
        split = self._split(module)
        if split is not None and (split[0] == 0 or kind == "weight"):  # a column-parallel bias splits too
            dim, rows, size = split
            return self._slice(name, tensor, dim, rows, size)
        if module in ROW_PARALLEL:  # a bias: added once
            return tensor if self._group.rank == 0 else None
        if module in ("embed_tokens", "lm_head") and kind == "weight":
            self._check(name, tensor, 0, "vocab")
            start, end = self.vocab_rows
            rows = tensor[start:end]
            padding = (end - start) - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(padding, rows.shape[1])]) if padding else rows.clone()
        # Norms, every rank holds them whole: over the hidden size, or per head (Qwen3's q/k norms).
        size = self._head_dim if module in ("q_norm", "k_norm") else self._hidden_size
        if "norm" in module and tensor.dim() == 1 and tensor.shape[0] == size:
            return tensor
        raise ValueError(f"tensor parallelism cannot split {name} {tuple(tensor.shape)}: it splits "
                         "q/k/v_proj, o_proj, gate/up/down_proj, embed_tokens and lm_head, and copies norms")

    def quantized(self, prefix: str) -> QuantizedWeight | None:
        """This rank's shard of the linear `prefix` as the checkpoint quantized it
        (quantization.linear_weight), or None where the checkpoint cannot say or
        the shard does not fall on its groups or blocks (then the float weight is
        split). Column-parallel linears keep their output rows, row-parallel ones
        their input columns: an int8 weight's per-row scales and a static scale
        stay whole, so each rank's partial sum is its share of the product, and
        the float bias (with a static format's offset share per rank) stays on rank 0."""
        quantized = getattr(self._weights, "quantized", None)
        split = self._split(prefix.rsplit(".", 1)[-1])
        weight = quantized(prefix) if quantized is not None and split is not None else None
        if weight is None or isinstance(weight, (torch.Tensor, Fp8BlockWeight)):
            return None  # split as its float weight
        dim, (start, end), _ = split
        if dim == 0:  # output rows
            if isinstance(weight, Int8Weight):
                return dataclasses.replace(weight, q=weight.q[start:end], scale=weight.scale[start:end])
            return dataclasses.replace(weight, codes=weight.codes[start:end], scale=weight.scale[start:end],
                                       low=weight.low[start:end])
        if isinstance(weight, Int8Weight):  # input columns
            return dataclasses.replace(weight, q=weight.q[:, start:end].contiguous())
        if start % GROUP or end % GROUP:
            return None
        groups = slice(start // GROUP, end // GROUP)
        return dataclasses.replace(weight, codes=weight.codes[:, start:end].contiguous(),
                                   scale=weight.scale[:, groups].contiguous(), low=weight.low[:, groups].contiguous())

    def _check(self, name: str, tensor: torch.Tensor, dim: int, size: str) -> None:
        if tensor.dim() <= dim or tensor.shape[dim] != self._sizes[size]:
            raise ValueError(f"tensor parallelism cannot split {name} {tuple(tensor.shape)}: "
                             f"dimension {dim} is not the config's {self._sizes[size]}")

    def _slice(self, name: str, tensor: torch.Tensor, dim: int, rows: tuple[int, int], size: str) -> torch.Tensor:
        self._check(name, tensor, dim, size)
        return tensor.narrow(dim, rows[0], rows[1] - rows[0]).clone()


class _VocabParallelEmbedding(torch.nn.Module):
    """An HF embedding module over this rank's vocabulary rows (TensorParallel.embed)."""

    def __init__(self, embedding: torch.nn.Module, group: TensorParallel):
        super().__init__()
        self.embedding, self._group = embedding, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._group.embed(self.embedding, self.embedding.weight.shape[0], input_ids)
