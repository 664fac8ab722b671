"""The validation trainer: a Llama-style model trained on real text under ZeRO stage 0-3 and
tensor parallelism, checkpointed through unickpt, resumable under another strategy.

Read top to bottom: configuration, the training step (forward per block, backward, ZeRO
reduction, global-norm clipping, AdamW on partitions), evaluation, checkpointing.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unickpt
from unickpt import UnifiedCheckpoint

from .data import TextData
from .metrics import append_line
from .model import Llama, LlamaConfig, hf_config
from .parallel import FlatUnit, Mesh, zero3_apply

__all__ = ["ParallelConfig", "OptimConfig", "UnifiedCheckpoint", "Trainer"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    zero_stage: int = 0
    """0: data parallel; 1: + partitioned optimizer state; 2: + gradients; 3: + parameters."""
    tp: int = 1
    """Tensor-parallel degree; the data-parallel degree is world_size / tp."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0..3, got {self.zero_stage}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor, as a fraction of ``lr``."""
    warmup: int = 10
    """Linear warmup steps."""
    total_steps: int = 1000
    """Length of the cosine schedule."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 1.0
    """Global gradient-norm clipping threshold (0: off)."""

    def lr_at(self, step: int) -> float:
        if step <= self.warmup:
            return self.lr * step / max(self.warmup, 1)
        frac = min(1.0, (step - self.warmup) / max(self.total_steps - self.warmup, 1))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class _Units:
    embed: FlatUnit
    layers: list[FlatUnit]
    head: FlatUnit

    def all(self) -> list[FlatUnit]:
        return [self.embed, *self.layers, self.head]


class Trainer:
    def __init__(
        self,
        model: LlamaConfig,
        data: TextData,
        *,
        parallel: ParallelConfig = ParallelConfig(),
        optim: OptimConfig = OptimConfig(),
        checkpoint: UnifiedCheckpoint | None = None,
        global_batch: int = 8,
        micro_batch: int = 4,
        dtype: str = "fp32",
        seed: int = 0,
        eval_every: int = 0,
        eval_samples: int = 32,
        metrics_jsonl: str | None = None,
        resume: str | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.cfg, self.data, self.parallel, self.optim, self.ckpt = model, data, parallel, optim, checkpoint
        self.mesh = Mesh.build(parallel.tp)
        dp = self.mesh.dp_size
        if global_batch % dp or (global_batch // dp) % min(micro_batch, global_batch // dp):
            raise ValueError(f"global_batch {global_batch} must split into dp={dp} shares of whole micro-batches of {micro_batch}")
        self.global_batch, self.local_batch = global_batch, global_batch // dp
        self.micro_batch = min(micro_batch, self.local_batch)
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.seed, self.eval_every, self.eval_samples = seed, eval_every, eval_samples
        self.metrics_jsonl = metrics_jsonl if self.mesh.rank == 0 else None
        if self.metrics_jsonl and os.path.dirname(self.metrics_jsonl):
            os.makedirs(os.path.dirname(self.metrics_jsonl), exist_ok=True)
        self.step = 0
        self.device = torch.device(device)
        torch.manual_seed(seed + self.mesh.rank)
        self.model = Llama(model, self.mesh.tp)
        self.model.init_weights(seed)
        self.model.to(device=self.device, dtype=self.dtype)
        self.units = self._build_units()
        self.history: list[dict] = []
        if checkpoint is not None:
            # the manager's manifests carry what a resume under another strategy needs
            checkpoint.strategy = {"zero_stage": parallel.zero_stage, "tp": parallel.tp, "dp": self.mesh.dp_size,
                                   "dtype": dtype}
            checkpoint.extra["model_config"] = asdict(model)
            checkpoint.extra_files["config.json"] = json.dumps(
                hf_config(model, {"fp32": "float32", "bf16": "bfloat16"}[dtype]), indent=2)
            if checkpoint.eps is None:
                checkpoint.eps = optim.eps
            user_hook = checkpoint.on_event

            def on_event(rec: dict) -> None:
                self._emit(rec)
                if user_hook is not None:
                    user_hook(rec)

            checkpoint.on_event = on_event
            if resume == "auto":  # newest first across tiers; a step that does not load is logged and skipped
                self._resume()
            else:  # the writers and staging now, so the first save costs what every later one does
                checkpoint.start(self.state_dict())

    # -- setup ------------------------------------------------------------------------------

    def _build_units(self) -> _Units:
        info = {n: (p, shape, dim) for n, p, shape, dim in self.model.hf_params()}

        def unit(name: str, names: list[str]) -> FlatUnit:
            params = []
            for n in names:
                p, shape, dim = info[n]
                offsets = [0] * len(shape)
                if dim is not None:
                    offsets[dim] = self.mesh.tp.rank * p.shape[dim]
                params.append((n, p, shape, tuple(offsets), dim))
            return FlatUnit(name, params, self.mesh, self.parallel.zero_stage, self.dtype)

        layers = []
        for i in range(self.cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            layers.append(unit(f"layer{i}", [n for n in info if n.startswith(pre)]))
        return _Units(
            unit("embed", ["model.embed_tokens.weight"]),
            layers,
            unit("head", ["model.norm.weight", "lm_head.weight"]),
        )

    # -- forward ------------------------------------------------------------------------------

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        m, u = self.model, self.units
        x = zero3_apply(u.embed, m.embed_tokens, tokens)
        cos, sin = m.rope(tokens.shape[1], self.dtype, self.device)
        for blk, unit in zip(m.layers, u.layers):
            x = zero3_apply(unit, lambda h, blk=blk: blk(h, cos, sin), x)
        return zero3_apply(u.head, lambda h: m.lm_head(m.norm(h)), x)

    def _loss_sum(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self._logits(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")

    # -- one optimizer step -------------------------------------------------------------------

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        B, T = self.global_batch, self.data.seq_len
        start = self.step * B + self.mesh.dp_rank * self.local_batch
        samples = self.data.samples(start, self.local_batch).to(self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(0, self.local_batch, self.micro_batch):
            mb = samples[i : i + self.micro_batch]
            loss = self._loss_sum(mb) / (B * T)  # normalised by the *global* token count
            loss.backward()
            loss_sum += loss.detach().double()
            if self.parallel.zero_stage < 3:
                for u in self.units.all():
                    u.after_backward()
        grads = [u.reduced_grad() for u in self.units.all()]
        sq = sum(u.sq_norm(g) for u, g in zip(self.units.all(), grads))
        if self.mesh.world > 1:
            sq = sq.clone()
            dist.all_reduce(sq)
            dist.all_reduce(loss_sum, group=self.mesh.dp_group)
        norm = float(sq.sqrt())
        if self.optim.clip and norm > self.optim.clip:
            for g in grads:
                g.mul_(self.optim.clip / (norm + 1e-6))
        if self.ckpt is not None:
            self.ckpt.wait_for_staging()  # the update below changes what is being staged
        self.step += 1
        lr = self.optim.lr_at(self.step)
        b1, b2 = self.optim.betas
        for u, g in zip(self.units.all(), grads):
            u.step(g, lr, b1, b2, self.optim.eps, self.optim.weight_decay, self.step)
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": float(loss_sum), "lr": lr, "grad_norm": norm, "tokens_per_s": B * T / dt}
        self._emit(rec)
        return rec

    @torch.no_grad()
    def evaluate(self) -> float:
        n = min(self.eval_samples, len(self.data.eval_windows))
        share = -(-n // self.mesh.dp_size)
        lo = min(self.mesh.dp_rank * share, n)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        windows = self.data.eval_windows[lo : min(lo + share, n)].to(self.device)
        for i in range(0, len(windows), self.micro_batch):
            b = windows[i : i + self.micro_batch]
            total[0] += float(self._loss_sum(b))
            total[1] += b[:, 1:].numel()
        if self.mesh.world > 1:
            dist.all_reduce(total, group=self.mesh.dp_group)
        loss = float(total[0] / total[1])
        self._emit({"event": "eval", "step": self.step, "eval_loss": loss})
        return loss

    def fit(self, steps: int) -> list[dict]:
        """Train until optimizer step ``steps`` (a total: a resumed run continues to the same end)."""
        out = []
        while self.step < steps:
            out.append(self.train_step())
            self.poll_save()
            self.checkpoint_step()
            if self.eval_every and self.step % self.eval_every == 0 and self.step < steps:
                self.evaluate()
        self.evaluate()
        self.wait_save()
        return out

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        model, master, m, v = {}, {}, {}, {}
        for u in self.units.all():
            st = u.state()
            model.update(st["model"])
            master.update(st["master"])
            m.update(st["exp_avg"])
            v.update(st["exp_avg_sq"])
        rng = torch.get_rng_state()  # per-rank CPU generator state, one row per rank
        world, n = self.mesh.world, rng.numel()
        return {
            "model": model,
            "master": master,
            "optimizer": {"exp_avg": m, "exp_avg_sq": v},
            "rng": {"torch_cpu": unickpt.shard(rng.view(1, n), (world, n), offsets=(self.mesh.rank, 0))},
            "trainer": {
                "step": self.step,
                "consumed_samples": self.step * self.global_batch,
                "data_seed": self.data.seed,
                "seq_len": self.data.seq_len,
                "global_batch": self.global_batch,
                "optim": {k: list(x) if isinstance(x, tuple) else x for k, x in asdict(self.optim).items()},
            },
        }

    def checkpoint_step(self) -> None:
        """After an optimizer step: what the checkpoint policy decides (a memory snapshot, a
        durable checkpoint or nothing: :meth:`unickpt.UnifiedCheckpoint.step`)."""
        if self.ckpt is not None:
            self.ckpt.step(self.step, self.state_dict())

    def save(self):
        """Checkpoint the current step now: the result, or with ``async_save`` a handle whose
        completion is reported (metrics, retention) once it is committed."""
        assert self.ckpt is not None
        return self.ckpt.save(self.step, self.state_dict())

    def poll_save(self) -> None:
        """Report a finished asynchronous save, if any (never blocks)."""
        if self.ckpt is not None:
            self.ckpt.poll()

    def wait_save(self) -> None:
        """Wait for the asynchronous save in flight; raise if it failed on any rank."""
        if self.ckpt is not None:
            self.ckpt.wait()

    def close(self) -> None:
        """Clean shutdown: :meth:`unickpt.UnifiedCheckpoint.close` (the save in flight, the
        durable tier brought up to the newest state, the memory tier freed)."""
        if self.ckpt is not None:
            self.ckpt.close()

    def _resume(self) -> None:
        sd = self.state_dict()
        loaded: dict = {}
        step = self.ckpt.resume(sd, check=lambda path, man: self._check(sd, path, man, loaded))
        if step is not None:
            self._restore(loaded)

    def load(self, path: str) -> unickpt.LoadResult:
        """Restore the whole training state from ``path`` (saved under any strategy)."""
        sd = self.state_dict()
        so = self.ckpt.storage_options if self.ckpt is not None else None
        ckpt, man = unickpt.read_manifest(path, group="world" if self.mesh.world > 1 else None, storage_options=so)
        loaded: dict = {}
        target = self._check(sd, ckpt, man, loaded) or sd
        res = unickpt.load(target, ckpt, options=unickpt.LoadOptions(storage_options=so))
        self._restore(loaded)
        if self.ckpt is not None:  # (later checkpoints replace those of an abandoned run; the error budget)
            self.ckpt.resumed_step, self.ckpt.lossy_generations = self.step, res.lossy_generations
        return res

    def _check(self, sd: dict, path: str, man, loaded: dict) -> dict | None:
        """Before ``path`` is read: refuse a checkpoint of another data order; another world
        size cannot map per-rank RNG streams one to one (they are reseeded after the load)."""
        tr = man.state.get("trainer", {})
        want = {"global_batch": self.global_batch, "seq_len": self.data.seq_len, "data_seed": self.data.seed}
        got = {k: tr.get(k) for k in want}
        if got != want:
            raise unickpt.errors.InvalidArgumentError(f"{path} was trained with {got}; this run uses {want}")
        loaded.update(state=sd, reseed=None)
        rng_saved = man.tensors.get(("rng", "torch_cpu"))
        if rng_saved is None or rng_saved.shape != sd["rng"]["torch_cpu"].layout.shape:
            loaded["reseed"] = self.seed * 7919 + self.mesh.rank + 1_000_003 * (man.step or 0)
            return {k: v for k, v in sd.items() if k != "rng"}
        return None

    def _restore(self, loaded: dict) -> None:
        sd = loaded["state"]
        if loaded["reseed"] is None:
            torch.set_rng_state(sd["rng"]["torch_cpu"].local.reshape(-1).clone())
        else:
            torch.manual_seed(loaded["reseed"])
        self.step = int(sd["trainer"]["step"])

    def _emit(self, rec: dict) -> None:
        self.history.append(rec)
        if self.metrics_jsonl:
            append_line(self.metrics_jsonl, json.dumps(rec) + "\n")  # (a FIFO there is refused, never waited on)
