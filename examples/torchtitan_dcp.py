"""torchtitan-shaped checkpoints through torch.distributed.checkpoint (DCP) into unickpt.

torchtitan's CheckpointManager keeps its checkpoint state as a dict of Stateful objects::

    {"model": ModelWrapper,            # get_model_state_dict (FSDP2: DTensors)
     "optimizer": OptimizersContainer, # get_optimizer_state_dict, flattened keys
     "lr_scheduler": LRSchedulersContainer,  # LambdaLR (warmup + cosine) state_dict
     "dataloader": ParallelAwareDataloader,  # {"dp_rank_<r>": pickle.dumps(state), "world_size": n}
     "train_state": TrainState}        # {"step", "ntokens_seen", "log_steps", "log_loss"}

and hands DCP ``dcp.save(states)`` / ``dcp.load(states)``. (torchtitan itself first moves the
model's keys to the top level, ``_flattened_model_states_sd``; unickpt then stores them in role
``other``, not ``model``: no ``model.safetensors.index.json``, and ``load_for_inference`` finds no
model. This example keeps them under ``"model"``.)

This script builds that shape with small self-contained classes (no torchtitan needed), trains
a tiny Llama-like model, and saves/resumes it with DCP's own ``dcp.save`` / ``dcp.async_save``
/ ``dcp.load``, changing only the storage: ``unickpt.dcp.StorageWriter`` and
``unickpt.dcp.StorageReader``. The checkpoints are ordinary unickpt ones: ``unickpt.load``,
``unickpt inspect`` and ``safetensors`` read them, in any layout.

    python examples/torchtitan_dcp.py --dir ckpt --steps 6 --save-every 3
    torchrun --nproc-per-node 2 examples/torchtitan_dcp.py --dir ckpt --steps 6 --save-every 3
    torchrun --nproc-per-node 2 examples/torchtitan_dcp.py --dir ckpt --steps 9 --save-every 3 --async-mode thread

Each run resumes from the newest committed ``step-*`` under ``--dir`` (``unickpt.latest``),
trains up to ``--steps`` and saves every ``--save-every`` steps into ``DIR/step-%08d``. With 2+
ranks the model is sharded with FSDP2 (``fully_shard``; gloo on CPU), so the state is DTensors.
Rank 0 prints one JSON line per step (``{"step", "loss", "lr"}``), one per save and resume
(what the dataloader and train state held), and a last ``{"verdict": ...}`` line; the exit
status is 0 only when every self-check passed. Training is deterministic (fixed seed and data,
``torch.use_deterministic_algorithms``): a resumed run prints the same losses, bit for bit, as
an uninterrupted one.

``--async-mode thread`` is torchtitan's ``async``: ``dcp.async_save`` on DCP's background
thread, over a separate gloo group (the save's collectives must not interleave with training's).
``--async-mode process`` is torchtitan's ``async_with_pinned_mem``: DCP's checkpoint process
(spawned: keep the ``if __name__ == "__main__":`` guard). Either way the previous save is waited
for before the next one starts and before the script exits.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import pickle
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

import unickpt
import unickpt.dcp

VOCAB, DIM, HIDDEN, SEQ, BATCH = 64, 32, 48, 16, 4


# -- the model: a one-block Llama (torchtitan's parameter names) ----------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)  # causal single-head attention
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(self.attention_norm(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.wo(att @ v)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(DIM, HIDDEN) for i in range(layers)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


# -- torchtitan's Stateful containers, in miniature -----------------------------------------


class ModelWrapper(Stateful):
    """torchtitan.components.checkpoint.ModelWrapper: the model parts' state dicts, merged."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        self.model = [model] if isinstance(model, nn.Module) else model

    def state_dict(self) -> dict[str, Any]:
        return {k: v for sd in map(get_model_state_dict, self.model) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(set_model_state_dict, model_state_dict=state_dict,
                                 options=StateDictOptions(strict=False))
        list(map(func, self.model))


class OptimizersContainer(Stateful):
    """torchtitan.components.optimizer.OptimizersContainer: one AdamW per model part, its
    state dict flattened (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``)."""

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model_parts: list[nn.Module], lr: float) -> None:
        self.model_parts = model_parts
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8,
                                             foreach=False)
                           for m in model_parts]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        func = functools.partial(get_optimizer_state_dict, options=self.OPTIONS)
        return {k: v for sd in map(func, self.model_parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(set_optimizer_state_dict, optim_state_dict=state_dict, options=self.OPTIONS)
        list(map(func, self.model_parts, self.optimizers))


def linear_warmup_cosine(warmup: int, total: int, min_ratio: float, step: int) -> float:
    """torchtitan's lr lambda (warmup, then cosine decay), bound with functools.partial."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedulersContainer(Stateful):
    """torchtitan.components.lr_scheduler.LRSchedulersContainer: a LambdaLR per optimizer,
    all stepped together; the state dict is the first one's (they are identical)."""

    def __init__(self, optimizers: OptimizersContainer, warmup: int, total: int) -> None:
        fn = functools.partial(linear_warmup_cosine, warmup, total, 0.1)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, fn) for o in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.load_state_dict(dict(state_dict))  # (LambdaLR.load_state_dict pops from its argument)


class ParallelAwareDataloader(Stateful):
    """torchtitan.components.dataloader.ParallelAwareDataloader: its state dict is
    ``{"dp_rank_<r>": pickle.dumps(inner state), "world_size": dp_world}``, *bytes* that the
    checkpoint stores verbatim (unickpt keeps them in the checksummed manifest and never
    unpickles them: this class does, as torchtitan does).

    The data: fixed pseudo-random token sequences, batch ``i`` of rank ``r`` a function of
    (seed, r, i) only, so restoring the position restores the stream."""

    def __init__(self, dp_rank: int, dp_world: int, seed: int, batch: int = BATCH, seq: int = SEQ) -> None:
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.batch, self.seq = batch, seq
        self._rank_id = f"dp_rank_{dp_rank}"
        self.position = 0  # batches consumed
        self.samples_seen = 0
        self.last_loaded: dict[str, Any] | None = None  # what the last load handed over (for the report)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dp_rank * 10_007 + self.position)
        tokens = torch.randint(0, VOCAB, (self.batch, self.seq + 1), generator=g)
        self.position += 1
        self.samples_seen += self.batch
        return tokens[:, :-1], tokens[:, 1:]

    def inner_state(self) -> dict[str, Any]:
        return {"dp_rank": self.dp_rank, "position": self.position, "samples_seen": self.samples_seen,
                "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_id: pickle.dumps(self.inner_state()), "world_size": self.dp_world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_loaded = dict(state_dict)
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            warnings.warn(f"dataloader state is empty for dp rank {self.dp_rank} (no key {self._rank_id!r})")
            return
        if state_dict["world_size"] != self.dp_world:
            # torchtitan asserts here (dataloader resharding is not supported); this example only
            # warns, so that a checkpoint loaded on another world size can still be inspected
            warnings.warn(f"dataloader saved on {state_dict['world_size']} dp ranks, loaded on {self.dp_world}: "
                          "its position is not restored")
            return
        inner = pickle.loads(state_dict[self._rank_id])  # our own bytes (torchtitan does the same)
        self.position, self.samples_seen = inner["position"], inner["samples_seen"]


@dataclass
class TrainState(Stateful):
    """torchtitan.trainer.TrainState: plain JSON values."""

    step: int = 0
    ntokens_seen: int = 0
    log_steps: list[int] = field(default_factory=list)
    log_loss: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "log_steps": list(self.log_steps),
                "log_loss": list(self.log_loss)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])
        self.log_steps = list(state_dict["log_steps"])
        self.log_loss = list(state_dict["log_loss"])


# -- set-up --------------------------------------------------------------------------------


@dataclass
class Job:
    model: nn.Module
    states: dict[str, Stateful]
    rank: int
    world: int

    @property
    def optimizers(self) -> OptimizersContainer:
        return self.states["optimizer"]

    @property
    def dataloader(self) -> ParallelAwareDataloader:
        return self.states["dataloader"]

    @property
    def train_state(self) -> TrainState:
        return self.states["train_state"]


def build(rank: int, world: int, seed: int, schedule_steps: int = 12, layers: int = 2) -> Job:
    """The model (FSDP2-sharded over ``world`` ranks when ``world`` > 1) and torchtitan's
    checkpoint state around it. Every rank builds the same initial model from ``seed``."""
    torch.manual_seed(seed)
    model = TinyLlama(layers)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer([model], lr=3e-3)
    states: dict[str, Stateful] = {
        "model": ModelWrapper(model),
        "optimizer": optimizers,
        "lr_scheduler": LRSchedulersContainer(optimizers, warmup=2, total=schedule_steps),
        "dataloader": ParallelAwareDataloader(rank, world, seed),
        "train_state": TrainState(),
    }
    return Job(model, states, rank, world)


def step_dir(root: str, step: int) -> str:
    """``root/step-%08d``: the names ``unickpt.latest`` looks for (torchtitan's own ``step-N``,
    unpadded, are not seen by it)."""
    return os.path.join(root, f"step-{step:08d}")


def emit(job: Job, record: dict[str, Any]) -> None:
    if job.rank == 0:
        print(json.dumps(record), flush=True)


def gathered(job: Job, value: Any) -> list[Any]:
    """``value`` of every rank (rank order)."""
    if job.world == 1:
        return [value]
    out: list[Any] = [None] * job.world
    dist.all_gather_object(out, value)
    return out


# -- checkpointing, as torchtitan's CheckpointManager does it --------------------------------


class Checkpointer:
    """Save with ``dcp.save`` / ``dcp.async_save`` through ``unickpt.dcp.StorageWriter``;
    resume with ``dcp.load`` through ``unickpt.dcp.StorageReader``."""

    def __init__(self, root: str, async_mode: str) -> None:
        self.root = root
        self.async_mode = async_mode
        self.pending = None  # (future, step, path) of the save in flight
        # torchtitan's async mode saves over a gloo group of its own: the background thread's
        # collectives must not interleave with the training's on the default group
        self.pg = dist.new_group(backend="gloo") if async_mode == "thread" and dist.is_initialized() else None

    def save(self, job: Job, step: int) -> None:
        self.wait()  # one save in flight at a time (torchtitan waits for the previous one too)
        path = step_dir(self.root, step)
        if self.async_mode == "none":
            dcp.save(job.states, storage_writer=unickpt.dcp.StorageWriter(path, options=unickpt.SaveOptions(step=step)))
            self._record(job, step, path, "saved")
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.async_mode == "thread":
            # the group goes to BOTH: unickpt's writer runs its own collectives on the group it is
            # given (default: the default group, where they would collide with FSDP's: gloo aborts)
            writer = unickpt.dcp.StorageWriter(path, options=unickpt.SaveOptions(step=step), process_group=self.pg)
            fut = dcp.async_save(job.states, storage_writer=writer, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.THREAD)
        else:  # process: the writer travels (pickled) to DCP's checkpoint process and uses that process's
            # default group; a ProcessGroup does not pickle, so no process_group= here
            writer = unickpt.dcp.StorageWriter(path, options=unickpt.SaveOptions(step=step))
            fut = dcp.async_save(job.states, storage_writer=writer,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        fut = getattr(fut, "upload_completion", fut)  # (an AsyncSaveResponse when the stager is asynchronous)
        self.pending = (fut, step, path)
        emit(job, {"event": "save_started", "step": step, "path": path, "async": self.async_mode})
        self._record(job, step, path, "save_staged")

    def wait(self) -> None:
        if self.pending is not None:
            fut, step, path = self.pending
            self.pending = None
            fut.result(timeout=600)
            _, man = unickpt.read_manifest(path)  # committed: its manifest reads, with its step
            if man.step != step:
                raise RuntimeError(f"async save of step {step} finished, but {path} holds step {man.step}")

    def _record(self, job: Job, step: int, path: str, event: str) -> None:
        """One line: what this save holds (every rank's dataloader position, the train state)."""
        dl = gathered(job, job.dataloader.inner_state())
        emit(job, {"event": event, "step": step, "path": path, "dataloader": dl,
                   "train_state": job.train_state.state_dict()})

    def resume(self, job: Job) -> int | None:
        """Load the newest committed checkpoint under the root, if any; its step."""
        path = unickpt.latest(self.root) if os.path.isdir(self.root) else None
        if path is None:
            return None
        dcp.load(job.states, storage_reader=unickpt.dcp.StorageReader(path))
        raw = job.dataloader.last_loaded or {}
        mine = raw.get(job.dataloader._rank_id)
        seen = gathered(job, {"type": type(mine).__name__,
                              "state": pickle.loads(mine) if isinstance(mine, bytes) else None,
                              "world_size": raw.get("world_size")})
        emit(job, {"event": "resumed", "step": job.train_state.step, "path": path, "dataloader": seen,
                   "train_state": job.train_state.state_dict()})
        return job.train_state.step


# -- training ------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    elif args.async_mode == "process":  # DCP's checkpoint process joins a process group: a group of one
        from torch.distributed.elastic.utils.distributed import get_free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(get_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.use_deterministic_algorithms(True)

    if not dist.is_initialized():  # (DCP says it assumes a single process: it is one)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    job = build(rank, world, args.seed, args.schedule_steps, args.layers)
    ckpt = Checkpointer(args.dir, args.async_mode)
    problems: list[str] = []
    resumed = ckpt.resume(job)
    if resumed is not None:  # self-checks of what came back
        dl = job.dataloader
        loaded = dl.last_loaded or {}
        saved_world = loaded.get("world_size")
        if not isinstance(loaded.get(dl._rank_id), bytes):
            problems.append(f"rank {rank}: the dataloader's state did not come back as bytes: {loaded!r:.200}")
        if saved_world == world and dl.position != resumed:
            problems.append(f"rank {rank}: dataloader at batch {dl.position}, checkpoint of step {resumed}")
        if job.train_state.log_steps != list(range(1, resumed + 1)) or len(job.train_state.log_loss) != resumed:
            problems.append(f"rank {rank}: train_state {job.train_state.state_dict()}")
        if job.train_state.ntokens_seen != resumed * (saved_world or 0) * BATCH * SEQ:
            problems.append(f"rank {rank}: train_state.ntokens_seen {job.train_state.ntokens_seen}")
    start = job.train_state.step
    saved: list[int] = []
    sched: LRSchedulersContainer = job.states["lr_scheduler"]
    for step in range(start + 1, args.steps + 1):
        inputs, labels = job.dataloader.next_batch()
        logits = job.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        lr = job.optimizers.optimizers[0].param_groups[0]["lr"]
        job.optimizers.step()
        sched.step()
        job.optimizers.zero_grad()
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
            global_loss /= world
        value = global_loss.item()
        ts = job.train_state
        ts.step = step
        ts.ntokens_seen += inputs.numel() * world
        ts.log_steps.append(step)
        ts.log_loss.append(value)
        emit(job, {"step": step, "loss": value, "lr": lr})
        if args.save_every and step % args.save_every == 0:
            ckpt.save(job, step)
            saved.append(step)
    ckpt.wait()
    problems = [p for ps in gathered(job, problems) for p in ps]
    emit(job, {"verdict": "FAIL" if problems else "ok", "problems": problems, "world": world, "resumed_from": resumed,
               "final_step": job.train_state.step, "saved": saved, "async_mode": args.async_mode,
               "latest": unickpt.latest(args.dir) if os.path.isdir(args.dir) else None})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # torch's gloo may abort at interpreter exit while an object holding a group lives (the
    # device mesh inside the FSDP2 model): free them while the interpreter is whole
    del job, ckpt, sched
    gc.collect()
    return 1 if problems else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint root: DIR/step-%%08d")
    p.add_argument("--steps", type=int, required=True, help="train up to this step (resuming counts)")
    p.add_argument("--save-every", type=int, default=0, help="save at every multiple of this step (0: never)")
    p.add_argument("--async-mode", choices=("none", "thread", "process"), default="none")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--schedule-steps", type=int, default=12,
                   help="length of the LR schedule (fixed, as in a torchtitan config: not --steps, which a resumed "
                        "run may change)")
    return p.parse_args(argv)


if __name__ == "__main__":  # (required: process-mode async save spawns a checkpoint process)
    sys.exit(train(parse()))
