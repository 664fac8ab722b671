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
from unickpt import async_save as _async_save
from unickpt import commit as _commit
from unickpt._metrics import log
from unickpt.storage import expand_node, join_path

from .data import TextData
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


@dataclass(kw_only=True)
class UnifiedCheckpoint:
    """Checkpointing of a :class:`Trainer` through unickpt."""

    dir: str
    every: int = 0
    """Save every N optimizer steps (0: only when ``Trainer.save()`` is called)."""
    keep: int = 0
    """Keep the newest K committed checkpoints (0: keep all)."""
    async_save: bool = False
    """Return to training once the state is copied into shared memory; a writer process saves."""
    overlap: bool = True
    """With ``async_save``: copy into staging while the next step's forward and backward run,
    waiting only before that step's optimizer update (weights and moments change only there)."""
    quant: str | None = None
    """``"O1"`` (8-bit) or ``"O2"`` (4-bit) Adam moments; ``None``: stored as they are."""
    max_generations: int | None = None
    """The error budget of ``quant``: once the state has been through this many lossy
    save/resume cycles, its moments are saved as they are (with a warning); ``None``: any
    number (docs/compression.md has the measured fidelity)."""
    master: str = "full"
    """``"full"``, ``"residual"`` (bit-exact from the bf16 weights + 2 bytes/param; bf16 training
    only, fp32 falls back to full) or ``"drop"`` (rebuilt from the model weights: exact for
    fp32 training, lossy for bf16)."""
    zstd: int | None = None
    """zstd level for optimizer and master files."""
    storage_options: dict | None = None
    """For a URL ``dir`` (``s3://bucket/run``, any fsspec URL): options of its file system
    (credentials and endpoint default to the standard AWS environment; docs/storage.md)."""

    memory_dir: str | None = None
    """In-memory tier (docs/memory_tier.md): node-local host memory for snapshots, a tmpfs path
    such as ``/dev/shm/run`` (``{node}`` is expanded per node; appended as a subdirectory when
    absent). Snapshots are complete checkpoints, taken asynchronously every ``memory_every``
    steps, replicated to ``memory_replicas`` other nodes, newest ``memory_keep`` kept; a
    resume picks the newest step complete across both tiers. ``None``: no memory tier."""
    memory_every: int = 1
    memory_replicas: int | None = None
    """Other nodes holding a copy of each node's snapshot files (``None``: 1 when the job spans
    several nodes, else 0)."""
    memory_keep: int = 2
    memory_skip_busy: bool = True
    """A snapshot due while the previous save is still being written is skipped (a
    ``snapshot_skipped`` metrics event), so the training loop never waits for the memory
    tier; ``False``: it waits (every ``memory_every``-th step is snapshotted). Durable
    checkpoints are never skipped."""
    memory_budget: int | None = None
    """Bytes of host memory per node the tier may take (``None``: the memory directory's free
    space and the host's available memory); checked before training starts."""

    def __post_init__(self) -> None:
        unickpt.Compression(quant=self.quant, master=self.master, zstd=self.zstd)  # validates
        if self.memory_dir is not None:
            for name, lo in (("memory_every", 1), ("memory_keep", 1)):
                v = getattr(self, name)
                if type(v) is not int or v < lo:
                    raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
            if self.memory_replicas is not None and (type(self.memory_replicas) is not int or self.memory_replicas < 0):
                raise ValueError(f"memory_replicas must be an integer >= 0 or None, got {self.memory_replicas!r}")
            if self.memory_budget is not None and (type(self.memory_budget) is not int or self.memory_budget < 1):
                raise ValueError(f"memory_budget must be a whole number of bytes >= 1 or None, got {self.memory_budget!r}")
            if "://" in self.memory_dir:
                raise ValueError(f"memory_dir must be a local (tmpfs) path, got {self.memory_dir!r}")
            if "{node}" not in self.memory_dir:
                self.memory_dir = os.path.join(self.memory_dir, "{node}")


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
        self._pending: unickpt.AsyncSave | None = None
        self._pending_tiers: list[str] = []
        self._durable_step = -1  # newest durable checkpoint this run wrote or resumed from
        self._resumed_from: int | None = None  # checkpoints of later steps belong to an abandoned run
        self._lossy_generations = 0  # lossy save/resume cycles the live state has been through
        self._dir_rank = self._manages_directory(checkpoint.dir) if checkpoint is not None else False
        self._mem_rank = False
        self._mem_job: str | None = None  # (the memory tier's job id, when it is on)
        if checkpoint is not None:
            self._sweep(checkpoint.dir)
            if checkpoint.memory_dir is not None:
                self._setup_memory_tier()
            if checkpoint.async_save or checkpoint.memory_dir is not None:
                # the writer's start (seconds) and the staging (seconds per GB) now, not in the
                # first save; after the memory budget check, which counts the staging
                unickpt.start_async_writer(self.state_dict())
        if resume == "auto" and checkpoint is not None:  # newest first; a step that does not load is logged and skipped
            self._resume_from_tiers()

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
        if self._pending is not None and not self._pending.staged():
            self._pending.wait_staged()  # the update below changes what is being staged
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
        """After an optimizer step: a memory snapshot every ``memory_every`` steps (with the
        durable checkpoint written from it by the writer processes when one is due), or a
        durable checkpoint every ``every`` steps."""
        c = self.ckpt
        if c is None:
            return
        durable = bool(c.every) and self.step % c.every == 0
        if c.memory_dir is not None and self.step % c.memory_every == 0:
            self._snapshot(durable)
        elif durable:
            self.save()

    def _save_kw(self) -> dict:
        strategy = {"zero_stage": self.parallel.zero_stage, "tp": self.parallel.tp, "dp": self.mesh.dp_size, "dtype": self.dtype_name}
        config = json.dumps(hf_config(self.cfg, {"fp32": "float32", "bf16": "bfloat16"}[self.dtype_name]), indent=2)
        comp = unickpt.Compression(quant=self.ckpt.quant, master=self.ckpt.master, zstd=self.ckpt.zstd, eps=self.optim.eps,
                                   max_generations=self.ckpt.max_generations)
        # a run resumed from step S replaces, as it reaches them, checkpoints of later steps
        # left by the run it continues (e.g. past a damaged snapshot it fell back from)
        overwrite = self._resumed_from is not None and self.step > self._resumed_from
        return dict(step=self.step, strategy=strategy, extra={"model_config": asdict(self.cfg)},
                    extra_files={"config.json": config}, compression=comp, overwrite=overwrite,
                    lossy_generations=self._lossy_generations)

    def _snapshot(self, durable: bool):
        """A memory snapshot of this step (asynchronous: the step pays the staging copy); with
        ``durable``, the writers also write the durable checkpoint from the same staging."""
        from unickpt import memtier

        c = self.ckpt
        # a snapshot is collective: every rank skips if any rank's previous save is still being
        # written. Each rank's handle finishes at its own moment (and poll_save drops it then),
        # so a rank deciding alone skipped while another saved, and both waited out timeout_s.
        busy = self._pending is not None and not self._pending.done()
        if c.memory_skip_busy and not durable and self._any_rank(busy):
            busy_with = self._pending.step if self._pending is not None else None
            self._emit({"event": "snapshot_skipped", "step": self.step, "busy_with": busy_with})
            if self.mesh.rank == 0:  # reported, never silent (the metrics file may be off)
                log.info("memory tier: no snapshot of step %d: a save%s is still being written", self.step,
                         f" (of step {busy_with})" if busy_with is not None else " on another rank")
            return None
        self.wait_save()  # back-pressure: one save in flight
        t0 = time.perf_counter()
        also = [join_path(c.dir, f"step-{self.step:08d}")] if durable else []
        kw = self._save_kw()
        kw["extra"] = {**kw["extra"], memtier.JOB_KEY: self._mem_job}  # resumes take only their own job's
        self._pending = unickpt.save(self.state_dict(), os.path.join(c.memory_dir, f"step-{self.step:08d}"),
                                     async_save=True, background_staging=c.overlap, replicas=self._mem_replicas,
                                     also=also, storage_options=c.storage_options, **kw)
        self._pending_tiers = ["memory"] + (["durable"] if durable else [])
        self._pending_t0, self._pending_block = t0, time.perf_counter() - t0
        return self._pending

    def save(self):
        """Checkpoint the current step. Synchronous, or with ``async_save`` a handle whose
        completion is reported (metrics, config.json, retention) once it is committed."""
        assert self.ckpt is not None
        t0 = time.perf_counter()
        path = join_path(self.ckpt.dir, f"step-{self.step:08d}")
        kw = dict(self._save_kw(), storage_options=self.ckpt.storage_options)
        if self.ckpt.async_save or self._pending is not None:
            self.wait_save()  # back-pressure: one save in flight
        if self.ckpt.async_save:
            t0 = time.perf_counter()
            self._pending = unickpt.save(self.state_dict(), path, async_save=True, background_staging=self.ckpt.overlap, **kw)
            self._pending_tiers = ["durable"]
            self._pending_t0, self._pending_block = t0, time.perf_counter() - t0
            return self._pending
        res = unickpt.save(self.state_dict(), path, **kw)
        total = time.perf_counter() - t0
        self._after_save(res, total, total, "durable")
        return res

    def poll_save(self) -> None:
        """Report a finished asynchronous save, if any (never blocks)."""
        if self._pending is not None and self._pending.done():
            self.wait_save()

    def wait_save(self) -> None:
        """Wait for the asynchronous save in flight; raise if it failed on any rank."""
        h, self._pending = self._pending, None
        if h is None:
            return
        h.wait()
        blocking = self._pending_block + h.staging_wait_seconds  # the save() call + waiting for staging
        for res, tier in zip(h.results, self._pending_tiers):
            self._after_save(res, blocking, h.total_seconds or (time.perf_counter() - self._pending_t0), tier)

    def _manages_directory(self, root: str) -> bool:
        """Rank 0; with node-local storage ({node} in the path) the first rank of each node."""
        from unickpt.storage import per_node
        from unickpt.transport import Comm, node_id

        if not per_node(root):
            return self.mesh.rank == 0
        nodes = Comm(None).all_gather_bytes(node_id().encode(), "trainer (the ranks' nodes)")
        return nodes.index(nodes[self.mesh.rank]) == self.mesh.rank

    def _any_rank(self, flag: bool) -> bool:
        if self.mesh.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _after_save(self, res, blocking: float, total: float, tier: str = "durable") -> None:
        if tier == "memory":
            if self._mem_rank:  # each node's first rank rotates that node's snapshots
                for old in unickpt.retain(self.ckpt.memory_dir, self.ckpt.memory_keep):
                    log.info("memory tier: rotated out %s", old)
        else:
            self._durable_step = max(self._durable_step, res.step if res.step is not None else -1)
            if self._dir_rank and self.ckpt.keep:
                _commit._fault_point("retention")
                for old in unickpt.retain(self.ckpt.dir, self.ckpt.keep, storage_options=self.ckpt.storage_options):
                    log.info("retention: deleted %s", old)
        self._emit({"event": "save", "tier": tier, "step": res.step, "blocking_s": blocking, "total_s": total,
                    "bytes": res.bytes})

    # -- the memory tier ---------------------------------------------------------------------

    def _setup_memory_tier(self) -> None:
        """Nodes, replicas, the memory budget (checked before the first step), ownership of
        this node's memory directory, and what a dead run left there."""
        from unickpt import memtier
        from unickpt.state import flatten
        from unickpt.transport import Comm, node_id

        c = self.ckpt
        comm = Comm(None)
        entries, _ = flatten(self.state_dict(), comm.rank, comm.world)
        local = _async_save.staging_bytes(entries)  # the segment, headroom and alignment included
        primary = sum(e.local.numel() * e.local.element_size() for e in entries if e.layout.replica == 0)
        me = {"node": node_id(), "pid": os.getpid(), "local": local, "primary": primary}
        everyone = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(me).encode(), "trainer (the memory budget)")]
        nodes = list(dict.fromkeys(r["node"] for r in everyone))
        replicas = c.memory_replicas if c.memory_replicas is not None else min(1, len(nodes) - 1)
        if replicas > len(nodes) - 1:
            raise unickpt.errors.InvalidArgumentError(
                f"memory_replicas={replicas}, but the job spans {len(nodes)} node(s): at most {len(nodes) - 1}")
        self._mem_replicas = replicas
        self._mem_rank = next(r for r, x in enumerate(everyone) if x["node"] == me["node"]) == comm.rank
        # writers are balanced over ranks: a node writes its ranks' share of the stored bytes
        stored = sum(r["primary"] for r in everyone)
        ranks_of = {n: sum(1 for r in everyone if r["node"] == n) for n in nodes}
        node_bytes = {n: -(-stored * ranks_of[n] // comm.world) for n in nodes}
        budget = memtier.plan_budget(node_bytes, me["node"], c.memory_keep, replicas,
                                     sum(r["local"] for r in everyone if r["node"] == me["node"]))
        memtier.check_budget(comm, c.memory_dir, budget, c.memory_budget)
        self._mem_pids = [r["pid"] for r in everyone if r["node"] == me["node"]]
        self._mem_job = self._job_id()
        err = None
        if self._mem_rank:
            try:
                memtier.claim(c.memory_dir, self._mem_job, self._mem_pids)
                for p in unickpt.sweep(c.memory_dir):
                    log.info("memory tier: removed %s, left by an interrupted snapshot", p)
            except Exception as e:
                err = e
        comm.agree(err, "memory tier (claiming the memory directories)")
        if self.mesh.rank == 0:
            log.info("memory tier: %d node(s), %d replica(s); per node %s", len(nodes), replicas, budget.describe())
        if self.mesh.world > 1:
            dist.barrier()

    def _job_id(self) -> str:
        """The job a memory directory and its snapshots belong to: the durable directory."""
        from unickpt.storage import is_url

        d = self.ckpt.dir
        return d if is_url(d) else os.path.abspath(d)

    def _resume_from_tiers(self) -> None:
        """Resume from the newest step complete in either tier (memory first at equal steps;
        without a memory tier, the durable steps); a candidate that fails to load (damaged,
        incomplete) is logged and the next one tried."""
        from unickpt import memtier
        from unickpt.transport import Comm

        comm = Comm(None)
        cands = memtier.candidates(comm, self.ckpt.memory_dir, self.ckpt.dir, self.ckpt.storage_options, self._mem_job)
        failed: set[int] = set()  # durable steps that do not load: the durable tier is behind them

        def durable_step() -> int:
            return max((c.step for c in cands if c.tier == "durable" and c.step not in failed), default=-1)

        self._durable_step = durable_step()
        last: Exception | None = None
        for cand in cands:
            avoid: list[str] = []
            retried = False  # the same on every rank (avoid is per node)
            while True:
                try:
                    self.load(cand.path, tier=cand.tier, avoid_local=avoid)
                    return
                except unickpt.errors.UnickptError as e:
                    last = e
                    if self.mesh.rank == 0:
                        log.warning("resume: %s step %d at %s does not load (%s)", cand.tier, cand.step, cand.path, e)
                    if cand.tier == "durable":  # close() must not count on it
                        failed.add(cand.step)
                        self._durable_step = durable_step()
                    if cand.tier != "memory" or retried:
                        break
                    retried = True
                    # a damaged copy: read the files the checks named from the nodes that hold
                    # another copy (every rank learns its own node's bad files), once
                    avoid = self._bad_copies(comm, e)
                    if not self._any_rank(bool(avoid)):  # no copy was found damaged: not worth a retry
                        break
                    log.warning("resume: retrying %s step %d without this node's copies of %s", cand.tier, cand.step,
                                ", ".join(avoid) or "nothing")
            if self.mesh.rank == 0:
                log.warning("resume: trying the next candidate")
        if last is not None:
            raise last

    def _bad_copies(self, comm, e: Exception) -> list[str]:
        """Collective: the data files whose copy on this rank's node failed its checks."""
        from unickpt.transport import node_id

        mine = sorted({f for f, _ in getattr(e, "bad", [])}) if isinstance(e, unickpt.errors.ChecksumError) else []
        everyone = [json.loads(b) for b in comm.all_gather_bytes(json.dumps([node_id(), mine]).encode(),
                                                                "trainer (damaged snapshot copies)")]
        return sorted({f for n, fs in everyone if n == node_id() for f in fs})

    def close(self) -> None:
        """Clean shutdown: wait for the save in flight; with the memory tier, write the newest
        state to the durable tier if the durable tier is behind, then free this node's
        snapshots (nothing is left in host memory)."""
        self.wait_save()
        c = self.ckpt
        if c is None or c.memory_dir is None:
            _async_save.shutdown()  # writer processes stopped, staging memory freed
            return
        if self._durable_step < self.step:
            self.save()
            self.wait_save()
        from unickpt import memtier

        if self.mesh.world > 1:
            dist.barrier()  # every rank is done with the snapshots
        if self._mem_rank:
            for p in memtier.clean(expand_node(c.memory_dir), owner_pids=self._mem_pids):
                log.info("memory tier: freed %s", p)
        _async_save.shutdown()  # writer processes stopped, staging memory freed
        if self.mesh.world > 1:
            dist.barrier()

    def _sweep(self, root: str) -> None:
        """At start: remove temporary directories of interrupted saves (rank 0) and staging
        segments of dead processes (every rank)."""
        from unickpt.async_save import sweep_segments

        sweep_segments()
        if self._dir_rank:
            for p in unickpt.sweep(root, storage_options=self.ckpt.storage_options if self.ckpt else None):
                log.info("removed %s, left by an interrupted save", p)
        if self.mesh.world > 1:
            dist.barrier()

    def load(self, path: str, tier: str = "durable", avoid_local: list[str] = ()) -> unickpt.LoadResult:
        """Restore the whole training state from ``path`` (saved under any strategy)."""
        t0 = time.perf_counter()
        sd = self.state_dict()
        so = self.ckpt.storage_options if self.ckpt is not None else None
        ckpt, man = unickpt.read_manifest(path, group="world" if self.mesh.world > 1 else None, storage_options=so)
        tr = man.state.get("trainer", {})
        want = {"global_batch": self.global_batch, "seq_len": self.data.seq_len, "data_seed": self.data.seed}
        got = {k: tr.get(k) for k in want}
        if got != want:
            raise unickpt.errors.InvalidArgumentError(  # checked before anything is loaded: the data order would differ
                f"{ckpt} was trained with {got}; this run uses {want}"
            )
        rng_saved = man.tensors.get(("rng", "torch_cpu"))
        rng_target = sd["rng"]["torch_cpu"]
        if rng_saved is None or rng_saved.shape != rng_target.layout.shape:
            # another world size: per-rank streams cannot map one to one; reseed per rank
            del sd["rng"]
            torch.manual_seed(self.seed * 7919 + self.mesh.rank + 1_000_003 * (man.step or 0))
        res = unickpt.load(sd, ckpt, storage_options=so, avoid_local=avoid_local)
        if "rng" in sd:
            torch.set_rng_state(sd["rng"]["torch_cpu"].local.reshape(-1).clone())
        self.step = int(sd["trainer"]["step"])
        self._resumed_from = self.step
        self._lossy_generations = res.lossy_generations  # (the error budget counts them: docs/compression.md)
        self._emit({"event": "load", "tier": tier, "step": self.step, "seconds": time.perf_counter() - t0,
                    "bytes_read": res.bytes_read, "path": res.path})
        return res

    def _emit(self, rec: dict) -> None:
        self.history.append(rec)
        if self.metrics_jsonl:
            from unickpt.localfs import append_text

            append_text(self.metrics_jsonl, json.dumps(rec) + "\n")  # (a FIFO there is refused, never waited on)
