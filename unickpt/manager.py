"""``UnifiedCheckpoint``: the checkpoint policy of a training loop, in four calls.

::

    ckpt = unickpt.UnifiedCheckpoint(dir="ckpt", every=100, keep=3, async_save=True, quant="O1",
                                     memory_dir="/dev/shm/run", memory_every=1)
    state = {"model": model, "optim": optim, "sched": sched, "data": loader, "step": 0}
    start = ckpt.resume(state)      # newest loadable step across tiers loaded into state, or None
    for step in range(start or 0, total):
        ...                         # train
        ckpt.step(step + 1, state)  # snapshot / durable save / retention by policy; returns quickly
    ckpt.close()                    # waits for pending saves, frees the memory tier cleanly

Every call is collective over ``group`` (every rank calls it, with the same step). What it
decides, in order:

* **start** (the first ``resume`` or ``step``): this user's dead saves under ``dir`` are
  swept, staging segments of dead processes freed; with a memory tier, the replicas that fit
  the nodes alive (an elastic restart on fewer nodes reduces them, with a warning and a
  ``memory_replicas_reduced`` event, and a later start on more nodes restores them), the memory
  budget checked, this node's memory directory claimed; the asynchronous writers started and
  the staging allocated, so the first save costs what every later one does.
* **resume**: the newest step complete in either tier (memory first at equal steps); one that
  does not load (damaged, incomplete, refused by ``check``) is logged and the next tried; a
  damaged memory copy is retried once from the nodes that hold another copy. A state that
  does not fit (dtype, shapes, keys) raises: an older step would not fit either. Once the
  newest durable step has loaded, retention runs (``keep``).
* **step(n)**: a memory snapshot every ``memory_every`` steps (skipped while the previous save
  is still being written, with ``memory_skip_busy``), which also writes the durable checkpoint
  when one is due; else a durable save every ``every`` steps. Asynchronous saves return after
  the staging copy (``overlap``: even before it; :meth:`wait_for_staging` before the state
  changes); retention runs when a save has committed.
* **close**: waits for the save in flight; with a memory tier, writes the newest state to the
  durable tier if it is behind, frees this node's snapshots and the staging memory.

Events (``on_event``): ``save`` (tier, step, blocking and total seconds, bytes),
``snapshot_skipped``, ``load`` (tier, step, seconds, bytes, path), ``memory_replicas_reduced``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Mapping

from . import errors
from ._metrics import log
from .compress import Compression
from .io.storage import expand_node, is_url, join_path, per_node


__all__ = ["UnifiedCheckpoint"]

Check = Callable[[str, Any], "Mapping[str, Any] | None"]


def _whole(name: str, v: Any, lo: int) -> int:
    """``v``, an int of at least ``lo`` (else InvalidArgumentError naming ``name``)."""
    if type(v) is not int or v < lo:
        raise errors.InvalidArgumentError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def _memory_dir(memory_dir: Any) -> str | None:
    """The memory tier's path per node (``{node}`` appended when absent), checked local."""
    if memory_dir is None:
        return None
    if not isinstance(memory_dir, (str, os.PathLike)) or not isinstance(os.fspath(memory_dir), str) \
            or not os.fspath(memory_dir):
        raise errors.InvalidArgumentError(f"memory_dir must be a non-empty local path or None, got {memory_dir!r}")
    md = os.fspath(memory_dir)
    if "://" in md:
        raise errors.InvalidArgumentError(f"memory_dir must be a local (tmpfs) path, got {md!r}")
    return md if "{node}" in md else os.path.join(md, "{node}")


def _check_apart(durable: str, memory: str | None, given: Any) -> None:
    """The durable tier must not lie inside the memory tier's root."""
    if memory is None or is_url(durable):
        return
    mem_root = os.path.realpath(memory.split("{node}")[0])
    if os.path.realpath(durable) == mem_root or os.path.realpath(durable).startswith(mem_root.rstrip("/") + "/"):
        raise errors.InvalidArgumentError(f"dir {durable!r} lies inside memory_dir {given!r}: the durable "
                                          "tier must be another place than the memory snapshots")


class UnifiedCheckpoint:
    """The checkpoint policy of a training loop (see the module doc)."""

    def __init__(
        self,
        dir: str | os.PathLike,
        *,
        every: int = 0,
        keep: int = 0,
        async_save: bool = False,
        overlap: bool = True,
        quant: str | None = None,
        master: str = "full",
        zstd: int | None = None,
        lossless: bool = False,
        max_generations: int | None = None,
        eps: float | None = None,
        memory_dir: str | os.PathLike | None = None,
        memory_every: int = 1,
        memory_replicas: int | None = None,
        memory_keep: int = 2,
        memory_skip_busy: bool = True,
        memory_budget: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        group: Any = None,
        on_event: Callable[[dict], None] | None = None,
        publish_dir: str | os.PathLike | None = None,
        publish_every: int = 1,
        publish_dtype: Any = None,
        publish_keep: int = 2,
    ) -> None:
        """
        Args:
            dir: the durable root: ``step-*`` checkpoints (a local path or a URL, ``{node}``
                for node-local storage).
            every: a durable checkpoint every N steps (0: only :meth:`save`).
            keep: keep the newest K committed durable checkpoints (0: all).
            async_save: return once the state is copied into shared memory; a writer
                process per rank saves.
            overlap: with ``async_save``, copy into staging while the next step's forward and
                backward run: call :meth:`wait_for_staging` before the optimizer changes the
                state.
            quant, master, zstd, lossless: compression (docs/compression.md).
            eps: Adam's ``eps``, which the O1/O2 codecs use (None: ``param_groups[0]["eps"]``
                of the first optimizer among the state's values, else 1e-8).
            max_generations: the error budget of ``quant``: once the state has been through
                this many lossy save/resume cycles, its moments are saved as they are.
            memory_dir: the in-memory tier (docs/memory_tier.md): a tmpfs path per node
                (``{node}`` is appended when absent). ``memory_every``, ``memory_replicas``
                (other nodes holding a copy; None: 1 when the job spans several nodes, else
                0; reduced with a warning when fewer nodes are alive), ``memory_keep``,
                ``memory_skip_busy``, ``memory_budget`` (bytes per node; None: free memory).
            storage_options: for a URL ``dir`` (and ``publish_dir``): options of its file system
                (docs/storage.md).
            timeout_s: bound of every wait for the other ranks (default ``UNICKPT_TIMEOUT_S``,
                else 600 s).
            group: the process group (None: the default group, or one process).
            on_event: called with each event (a dict; see the module doc).
            publish_dir: live weight updates (docs/serving.md): every ``publish_every`` steps
                the state's ``"model"`` role, cast to ``publish_dtype`` (None: as it is), is
                published there as a version for :class:`~unickpt.WeightSubscriber` readers;
                the newest ``publish_keep`` versions, and every version a reader is reading,
                are kept. A file system path (local, tmpfs, shared).
        """
        if not isinstance(dir, (str, os.PathLike)) or not os.fspath(dir) or not isinstance(os.fspath(dir), str):
            raise errors.InvalidArgumentError(f"dir must be a non-empty path or URL, got {dir!r}")
        self.dir = os.fspath(dir)
        self.every, self.keep = _whole("every", every, 0), _whole("keep", keep, 0)
        for name, v in (("async_save", async_save), ("overlap", overlap), ("memory_skip_busy", memory_skip_busy)):
            if type(v) is not bool:
                raise errors.InvalidArgumentError(f"{name} must be True or False, got {v!r}")
        self.async_save, self.overlap, self.memory_skip_busy = async_save, overlap, memory_skip_busy
        self.compression = Compression(quant=quant, master=master, zstd=zstd, lossless=lossless,
                                       max_generations=max_generations)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0):
            raise errors.InvalidArgumentError(f"eps must be a number > 0 or None, got {eps!r}")
        self.eps = None if eps is None else float(eps)
        self.memory_dir = _memory_dir(memory_dir)
        self.memory_every, self.memory_keep = _whole("memory_every", memory_every, 1), _whole("memory_keep", memory_keep, 1)
        if memory_replicas is not None:
            _whole("memory_replicas", memory_replicas, 0)
        self.memory_replicas = memory_replicas
        if memory_budget is not None:
            _whole("memory_budget", memory_budget, 1)
        self.memory_budget = memory_budget
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise errors.InvalidArgumentError(f"storage_options must be a dict or None, got {storage_options!r}")
        self.storage_options = dict(storage_options) if storage_options is not None else None
        if timeout_s is not None:
            from .transport import resolve_timeout

            resolve_timeout(timeout_s)  # (InvalidArgumentError: not a positive, finite number of seconds)
        if on_event is not None and not callable(on_event):
            raise errors.InvalidArgumentError(f"on_event must be a callable taking one dict, or None, got {on_event!r}")
        if memory_dir is None:
            given = [n for n, v, d in (("memory_every", memory_every, 1), ("memory_replicas", memory_replicas, None),
                                       ("memory_keep", memory_keep, 2), ("memory_budget", memory_budget, None),
                                       ("memory_skip_busy", memory_skip_busy, True)) if v != d]
            if given:
                log.warning("UnifiedCheckpoint: %s set without memory_dir: the memory tier is off, they do nothing",
                            ", ".join(given))
        _check_apart(self.dir, self.memory_dir, memory_dir)
        self.timeout_s, self.group, self.on_event = timeout_s, group, on_event
        self.publish_dir = None if publish_dir is None else os.fspath(publish_dir)
        if self.publish_dir is not None:
            from .publish import _publish_storage

            _publish_storage(self.publish_dir, storage_options)  # (refused now, not at the first step)
            for a, b in ((self.dir, self.publish_dir), (self.publish_dir, self.dir),
                         *(((self.memory_dir, self.publish_dir), (self.publish_dir, self.memory_dir))
                           if self.memory_dir else ())):
                ra, rb = os.path.realpath(a.split("{node}")[0]), os.path.realpath(b.split("{node}")[0])
                if not is_url(a) and (ra == rb or ra.startswith(rb.rstrip("/") + "/")):
                    raise errors.InvalidArgumentError(
                        f"publish_dir {self.publish_dir!r} and {'dir' if self.dir in (a, b) else 'memory_dir'} must be "
                        "apart (neither inside the other): each retires old step-* directories of its own")
        self.publish_every, self.publish_keep = _whole("publish_every", publish_every, 1), _whole("publish_keep",
                                                                                                 publish_keep, 1)
        import torch

        if publish_dtype is not None and not (isinstance(publish_dtype, torch.dtype) and publish_dtype.is_floating_point):
            raise errors.InvalidArgumentError(f"publish_dtype must be a floating torch dtype or None, got {publish_dtype!r}")
        self.publish_dtype = publish_dtype
        self.extra: dict[str, Any] = {}
        """Added to every checkpoint's manifest ``extra`` (the trainer records its model config)."""
        self.extra_files: dict[str, str] = {}
        """Small text files written into every checkpoint (``config.json``...)."""
        self.strategy: dict[str, Any] = {}
        """Free-form description of the saving layout, recorded in every manifest."""
        self.durable_step = -1
        """The newest step committed to the durable tier by this run, or resumed from it."""
        self.lossy_generations = 0
        """Lossy save/resume cycles the live state has been through (the error budget)."""
        self.resumed_step: int | None = None
        self._init_run_state()

    def _init_run_state(self) -> None:
        """What the manager learns while it runs (set by :meth:`start` and the saves)."""
        self._started = False
        self._closed = False
        self._pending: Any = None  # the asynchronous save in flight (unickpt.AsyncSave)
        self._pending_tiers: list[str] = []
        self._pending_t0 = self._pending_block = 0.0
        self._last: tuple[int, Mapping[str, Any]] | None = None  # (step, state) of the newest step() call
        self._comm: Any = None
        self._dir_rank = self._mem_rank = False
        self._mem_replicas = 0
        self._mem_pids: list[int] = []
        self._mem_job = self.dir if is_url(self.dir) else os.path.abspath(self.dir)

    # -- the four calls ---------------------------------------------------------------------

    def resume(self, state: Mapping[str, Any], *, check: Check | None = None) -> int | None:
        """Load the newest step that loads, across the memory and durable tiers, into
        ``state`` (in place, as :func:`unickpt.load`); return its step, or None when there is
        none (``state`` untouched). ``check(path, manifest)``, called before a candidate is
        read, may raise a :class:`~unickpt.errors.UnickptError` to refuse it (the next one is
        tried) or return the state to load it into instead (a trimmed copy of ``state``).

        Only a candidate that is damaged, incomplete or unreadable (checksums, format, missing
        files, storage errors) or refused by ``check`` makes way for the next one. A state that
        does not fit the newest checkpoint (another dtype without ``cast``, other shapes, keys
        it lacks) raises: an older step would not fit either, and resuming from one would let
        the next save replace the newer, sound checkpoint."""
        from . import memtier

        self._start(state)
        cands = memtier.candidates(self._comm, self.memory_dir, self.dir, self.storage_options,
                                   self._mem_job if self.memory_dir else None)
        failed: set[int] = set()

        def durable_step() -> int:
            return max((c.step for c in cands if c.tier == "durable" and c.step not in failed), default=-1)

        self.durable_step = durable_step()
        last: Exception | None = None
        for cand in cands:
            avoid: list[str] = []
            retried = False  # the same on every rank (avoid is per node)
            while True:
                try:
                    step = self._load(state, cand.path, cand.tier, avoid, check)
                    self.resumed_step = step
                    self._last = (step, state)  # close() makes it durable if only memory holds it
                    if cand.tier == "durable" and step == self.durable_step:
                        self._retain_after_resume()
                    return step
                except errors.UnickptError as e:
                    # the state does not fit this checkpoint (on any rank: the others see a
                    # DistributedError): an older one would not fit either, and falling back
                    # would let a later save replace a sound checkpoint
                    if self._any_rank(isinstance(e, _MISFITS)):
                        raise
                    if isinstance(e, _Refused):
                        last = e.error
                        if self._comm.rank == 0:
                            log.warning("resume: %s step %d at %s refused by check (%s)", cand.tier, cand.step,
                                        expand_node(cand.path), e.error)
                        break
                    # damaged, incomplete or unreadable: the next candidate
                    last = e
                    if self._comm.rank == 0:
                        log.warning("resume: %s step %d at %s does not load (%s)", cand.tier, cand.step,
                                    expand_node(cand.path), e)
                    if cand.tier == "durable":  # close() must not count on it
                        failed.add(cand.step)
                        self.durable_step = durable_step()
                    if cand.tier != "memory" or retried:
                        break
                    retried = True
                    # a damaged copy: read the files the checks named from the nodes that hold
                    # another copy (every rank learns its own node's bad files), once
                    avoid = self._bad_copies(e)
                    if not self._any_rank(bool(avoid)):
                        break
                    log.warning("resume: retrying %s step %d without this node's copies of %s", cand.tier, cand.step,
                                ", ".join(avoid))
            if self._comm.rank == 0:
                log.warning("resume: trying the next candidate")
        if last is not None:
            raise last
        return None

    def step(self, step: int, state: Mapping[str, Any]) -> None:
        """After optimizer step ``step`` (collective): a memory snapshot, a durable save or
        nothing, by policy (module doc); reports a finished asynchronous save. Returns once
        the state is staged, or sooner with ``overlap``."""
        self._check_step(step)
        self._start(state)
        self._last = (step, state)
        self.poll()
        durable = bool(self.every) and step % self.every == 0
        if self.memory_dir is not None and step % self.memory_every == 0:
            self._snapshot(step, state, durable)
        elif durable:
            self.save(step, state)
        if self.publish_dir is not None and step % self.publish_every == 0:
            self._publish(step, state)

    def _publish(self, step: int, state: Mapping[str, Any]) -> None:
        """The model role as version ``step`` of ``publish_dir`` (collective; unickpt.publish)."""
        from .publish import publish

        if "model" not in state:
            raise errors.InvalidArgumentError("publish_dir: the state has no 'model' entry to publish")
        t0 = time.perf_counter()
        try:
            res = publish(state["model"], self.publish_dir, step, dtype=self.publish_dtype, keep=self.publish_keep,
                          group=self.group, storage_options=self.storage_options, timeout_s=self.timeout_s)
        except errors.NewerVersionError as e:
            # a run that started over (not resumed) on a publish_dir holding newer versions: nothing it
            # publishes would reach a subscriber until it passes them
            log.warning("publish_dir: %s", e)
            self._emit({"event": "publish_skipped", "step": step, "reason": "older"})
            return
        except errors.CheckpointExistsError:
            # a resumed run reaching a step an earlier run published: that version stays (a committed
            # checkpoint is replaced only by a newer one); subscribers move on at the next step published
            log.warning("publish_dir: version %d was published by an earlier run; not published again", step)
            self._emit({"event": "publish_skipped", "step": step, "reason": "exists"})
            return
        self._emit({"event": "published", "step": step, "path": res.path, "seconds": time.perf_counter() - t0})

    def save(self, step: int, state: Mapping[str, Any]) -> Any:
        """A durable checkpoint of ``step`` now (collective): the :class:`~unickpt.SaveResult`,
        or with ``async_save`` the :class:`~unickpt.AsyncSave` (reported when committed)."""
        from . import api

        self._check_step(step)
        self._start(state)
        self._last = (step, state)
        path = join_path(self.dir, f"step-{step:08d}")
        opts = self._options(step, state)
        self.wait()  # back-pressure: one save in flight
        t0 = time.perf_counter()
        if self.async_save:
            self._pending = api.save_async(state, path, group=self.group, options=opts,
                                           background_staging=self.overlap)
            self._pending_tiers = ["durable"]
            self._pending_t0, self._pending_block = t0, time.perf_counter() - t0
            return self._pending
        res = api.save(state, path, group=self.group, options=opts)
        total = time.perf_counter() - t0
        self._after_save(res, total, total, "durable")
        return res

    def _check_step(self, step: int) -> None:
        if type(step) is not int or step < 0:
            raise errors.InvalidArgumentError(f"step must be an integer >= 0, got {step!r}")
        if self._last is not None and step < self._last[0]:
            raise errors.InvalidArgumentError(f"step {step} after step {self._last[0]}: steps only go forward (a new "
                                              "run resumes with resume(), in a new UnifiedCheckpoint)")
        if self._closed:
            raise errors.InvalidArgumentError("this UnifiedCheckpoint is closed: make a new one")

    def start(self, state: Mapping[str, Any]) -> None:
        """Optional (collective): what the first :meth:`resume` or :meth:`step` does first,
        now (sweep, memory tier, writer processes and staging for ``state``), for a loop that
        starts without resuming and wants its first save to cost what every later one does."""
        self._start(state)

    def wait_for_staging(self) -> None:
        """Wait until the save in flight has copied the state (with ``overlap`` the copy runs
        beside the next step's forward and backward: call this before the optimizer step)."""
        if self._pending is not None and not self._pending.staged():
            self._pending.wait_staged()

    def poll(self) -> None:
        """Report an asynchronous save that has finished, if any (never blocks)."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; raise if it failed on any rank."""
        h, self._pending = self._pending, None
        if h is None:
            return
        h.wait()
        blocking = self._pending_block + h.staging_wait_seconds  # the save call + waiting for staging
        for res, tier in zip(h.results, self._pending_tiers):
            self._after_save(res, blocking, h.total_seconds or (time.perf_counter() - self._pending_t0), tier)

    def close(self, *, final_save: bool = True) -> None:
        """Clean shutdown (collective): wait for the save in flight; write the newest state
        :meth:`step` was given to the durable tier if it is behind (with ``every`` > 0 or the
        memory tier, and ``final_save``: a finished run keeps its last step, as torchtitan
        saves at its last step; pass ``final_save=False`` when closing after a failure); free
        this node's memory snapshots; stop the writer processes and free the staging memory."""
        from . import async_save, memtier

        if type(final_save) is not bool:
            raise errors.InvalidArgumentError(f"final_save must be True or False, got {final_save!r}")
        self.wait()
        if self._started and final_save and (self.every or self.memory_dir is not None):
            if self._last is not None and self.durable_step < self._last[0]:
                self.save(*self._last)
                self.wait()
        if self._started and self.memory_dir is not None:
            self._comm.barrier("checkpoint close (every rank is done with the snapshots)")
            if self._mem_rank:
                for p in memtier.clean(expand_node(self.memory_dir), owner_pids=self._mem_pids):
                    log.info("memory tier: freed %s", p)
        async_save.shutdown()  # writer processes stopped, staging memory freed
        if self._started:
            self._comm.barrier("checkpoint close (writers stopped)")
        self._started = False
        self._closed = True
        self._comm = None  # (holds no process group past close: destroy_process_group frees them)

    # -- start -------------------------------------------------------------------------------

    def _start(self, state: Mapping[str, Any]) -> None:
        if self._started:
            return
        from . import api, async_save
        from .transport import Comm, node_id

        self._comm = Comm(self.group, timeout_s=self.timeout_s)
        nodes = self._comm.all_gather_bytes(node_id().encode(), "checkpoint start (the ranks' nodes)")
        me = self._comm.rank
        self._dir_rank = (nodes.index(nodes[me]) == me) if per_node(self.dir) else me == 0
        async_save.sweep_segments()

        def sweep_dir() -> None:
            from . import sweep

            if self._dir_rank:
                for p in sweep(self.dir, storage_options=self.storage_options, timeout_s=self.timeout_s):
                    log.info("removed %s, left by an interrupted save", p)

        self._comm.step("checkpoint start (sweeping)", sweep_dir)
        if self.memory_dir is not None:
            self._setup_memory_tier(state, [n.decode() for n in nodes])
        if self.async_save or self.memory_dir is not None:
            # the writer's start (seconds) and the staging (seconds per GB) now, not in the
            # first save; after the memory budget check, which counts the staging
            api.start_async_writer(state, group=self.group)
        self._started = True

    def _setup_memory_tier(self, state: Mapping[str, Any], nodes: list[str]) -> None:
        """Replicas that fit the nodes alive, the memory budget (before the first step),
        ownership of this node's memory directory, and what a dead run left there."""
        from . import async_save, memtier, sweep
        from .state import flatten
        from .stateful import for_save

        comm = self._comm
        assert self.memory_dir is not None
        entries, _ = flatten(for_save(state), comm.rank, comm.world)
        local = async_save.staging_bytes(entries)  # the segment, headroom and alignment included
        primary = sum(e.local.numel() * e.local.element_size() for e in entries if e.layout.replica == 0)
        me = {"node": nodes[comm.rank], "pid": os.getpid(), "local": local, "primary": primary}
        everyone = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(me).encode(), "checkpoint start (memory budget)")]
        alive = list(dict.fromkeys(r["node"] for r in everyone))
        want = self.memory_replicas if self.memory_replicas is not None else min(1, len(alive) - 1)
        self._mem_replicas = min(want, len(alive) - 1)
        if self._mem_replicas < want:  # an elastic restart on fewer nodes: degrade, never refuse
            if comm.rank == 0:
                log.warning("memory tier: memory_replicas=%d, but %d node(s) are alive: %d replica(s) until more nodes "
                            "join (a later start restores %d)", want, len(alive), self._mem_replicas, want)
            self._emit({"event": "memory_replicas_reduced", "wanted": want, "replicas": self._mem_replicas,
                        "nodes": len(alive)})
        self._mem_rank = next(r for r, x in enumerate(everyone) if x["node"] == me["node"]) == comm.rank
        stored = sum(r["primary"] for r in everyone)  # writers are balanced over ranks
        ranks_of = {n: sum(1 for r in everyone if r["node"] == n) for n in alive}
        node_bytes = {n: -(-stored * ranks_of[n] // comm.world) for n in alive}
        budget = memtier.plan_budget(node_bytes, me["node"], self.memory_keep, self._mem_replicas,
                                     sum(r["local"] for r in everyone if r["node"] == me["node"]))
        memtier.check_budget(comm, self.memory_dir, budget, self.memory_budget)
        self._mem_pids = [r["pid"] for r in everyone if r["node"] == me["node"]]

        def claim() -> None:
            assert self.memory_dir is not None
            if self._mem_rank:
                memtier.claim(self.memory_dir, self._mem_job, self._mem_pids)
                for p in sweep(self.memory_dir):
                    log.info("memory tier: removed %s, left by an interrupted snapshot", p)

        comm.step("checkpoint start (claiming the memory directories)", claim)
        if comm.rank == 0:
            log.info("memory tier: %d node(s), %d replica(s); per node %s", len(alive), self._mem_replicas,
                     budget.describe())

    # -- saves -------------------------------------------------------------------------------

    def _options(self, step: int, state: Mapping[str, Any]):
        from .saving import SaveOptions

        comp = self.compression
        eps = self.eps if self.eps is not None else _optimizer_eps(state)
        if eps is not None and comp.quant is not None:
            from dataclasses import replace

            comp = replace(comp, eps=eps)
        # a run resumed from step S replaces, as it reaches them, checkpoints of later steps
        # left by the run it continues (e.g. past a damaged snapshot it fell back from)
        overwrite = self.resumed_step is not None and step > self.resumed_step
        return SaveOptions(step=step, compression=comp if comp.active else None, overwrite=overwrite,
                           storage_options=self.storage_options, timeout_s=self.timeout_s,
                           extra=dict(self.extra) or None, extra_files=dict(self.extra_files) or None,
                           strategy=dict(self.strategy) or None, lossy_generations=self.lossy_generations)

    def _snapshot(self, step: int, state: Mapping[str, Any], durable: bool) -> None:
        """A memory snapshot of this step (asynchronous: the step pays the staging copy); with
        ``durable``, the writers also write the durable checkpoint from the same staging."""
        from dataclasses import replace

        from . import api, memtier

        assert self.memory_dir is not None
        # a snapshot is collective: every rank skips if any rank's previous save is still being
        # written (each rank's handle finishes at its own moment; a rank deciding alone would
        # skip while another saved, and both would wait out timeout_s)
        busy = self._pending is not None and not self._pending.done()
        if self.memory_skip_busy and not durable and self._any_rank(busy):
            busy_with = self._pending.step if self._pending is not None else None
            self._emit({"event": "snapshot_skipped", "step": step, "busy_with": busy_with})
            if self._comm.rank == 0:  # reported, never silent (the metrics file may be off)
                log.info("memory tier: no snapshot of step %d: a save%s is still being written", step,
                         f" (of step {busy_with})" if busy_with is not None else " on another rank")
            return
        self.wait()  # back-pressure: one save in flight
        t0 = time.perf_counter()
        opts = self._options(step, state)
        opts = replace(opts, extra={**(opts.extra or {}), memtier.JOB_KEY: self._mem_job},  # resumes take their job's
                       replicas=self._mem_replicas)
        also = [join_path(self.dir, f"step-{step:08d}")] if durable else []
        self._pending = api.save_async(state, os.path.join(self.memory_dir, f"step-{step:08d}"), group=self.group,
                                       options=opts, background_staging=self.overlap, also=also)
        self._pending_tiers = ["memory"] + (["durable"] if durable else [])
        self._pending_t0, self._pending_block = t0, time.perf_counter() - t0

    def _retain_after_resume(self) -> None:
        """A run that died between a commit and its retention left more than ``keep``: once the
        newest durable step has loaded (read and verified), retention runs (never when an
        older step was resumed: the newer ones may be damaged, and would count as kept)."""
        if not (self._dir_rank and self.keep):
            return
        from . import retain

        try:
            for old in retain(self.dir, self.keep, storage_options=self.storage_options, timeout_s=self.timeout_s):
                log.info("retention: deleted %s", old)
        except errors.UnickptError as e:  # (this rank alone: the next commit's retention tries again)
            log.warning("retention after resume failed: %s", e)

    def _after_save(self, res: Any, blocking: float, total: float, tier: str) -> None:
        from . import retain

        if tier == "memory":
            if self._mem_rank:  # each node's first rank rotates that node's snapshots
                assert self.memory_dir is not None
                for old in retain(self.memory_dir, self.memory_keep):
                    log.info("memory tier: rotated out %s", old)
        else:
            self.durable_step = max(self.durable_step, res.step if res.step is not None else -1)
            if self._dir_rank and self.keep:
                for old in retain(self.dir, self.keep, storage_options=self.storage_options, timeout_s=self.timeout_s):
                    log.info("retention: deleted %s", old)
        self._emit({"event": "save", "tier": tier, "step": res.step, "blocking_s": blocking, "total_s": total,
                    "bytes": res.bytes})

    # -- loads -------------------------------------------------------------------------------

    def _load(self, state: Mapping[str, Any], path: str, tier: str, avoid: list[str], check: Check | None) -> int:
        from . import loading as loader

        t0 = time.perf_counter()
        group = "world" if self.group is None else self.group
        ckpt, man = loader.read_manifest(path, group=group if self._comm.world > 1 else None,
                                         storage_options=self.storage_options)
        target = state
        if check is not None:
            try:
                got = check(ckpt, man)
            except errors.UnickptError as e:
                raise _Refused(e) from e
            if got is not None:
                target = got
        res = loader.load(target, ckpt, group=self.group,
                          options=loader.LoadOptions(storage_options=self.storage_options, timeout_s=self.timeout_s,
                                                     avoid_local=tuple(avoid)))
        self.lossy_generations = res.lossy_generations  # (the error budget counts them: docs/compression.md)
        step = man.step if man.step is not None else -1
        self._emit({"event": "load", "tier": tier, "step": step, "seconds": time.perf_counter() - t0,
                    "bytes_read": res.bytes_read, "path": res.path})
        return step

    def _bad_copies(self, e: Exception) -> list[str]:
        """Collective: the data files whose copy on this rank's node failed its checks."""
        from .transport import node_id

        mine = sorted({f for f, _ in getattr(e, "bad", [])}) if isinstance(e, errors.ChecksumError) else []
        everyone = [json.loads(b) for b in self._comm.all_gather_bytes(json.dumps([node_id(), mine]).encode(),
                                                                      "resume (damaged snapshot copies)")]
        return sorted({f for n, fs in everyone if n == node_id() for f in fs})

    # -- helpers -----------------------------------------------------------------------------

    def _any_rank(self, flag: bool) -> bool:
        if self._comm.world == 1:
            return flag
        return any(b == b"1" for b in self._comm.all_gather_bytes(b"1" if flag else b"0", "checkpoint (any rank busy)"))

    def _emit(self, rec: dict) -> None:
        if self.on_event is not None:
            self.on_event(rec)


class _Refused(errors.UnickptError):
    """A candidate refused by ``resume``'s ``check`` (the next one is tried)."""

    def __init__(self, error: errors.UnickptError) -> None:
        super().__init__(str(error))
        self.error = error


#: errors that say the state does not fit a checkpoint, not that the checkpoint is damaged:
#: ``resume`` raises them instead of trying an older step
_MISFITS = (errors.DtypeMismatchError, errors.ShapeMismatchError, errors.TensorMissingError, errors.LayoutError,
            errors.StateDictError, errors.InvalidArgumentError, errors.NotSupportedError, errors.MemoryBudgetError)


def _optimizer_eps(state: Mapping[str, Any]) -> float | None:
    """``eps`` of the first optimizer among the state's top-level values (what O1/O2 need)."""
    import torch

    for v in state.values() if isinstance(state, Mapping) else ():
        if isinstance(v, torch.optim.Optimizer):
            eps = v.param_groups[0].get("eps") if v.param_groups else None
            if isinstance(eps, float) and eps > 0:
                return eps
    return None
