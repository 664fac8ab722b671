"""The save pipeline: ``plan -> open -> write -> commit``, each stage one call agreed by every
rank (:meth:`~unickpt.transport.Comm.step`: a failure anywhere raises everywhere, and no rank
goes on alone into the next collective).

* **plan** (:func:`plan_stage`): flatten the state, gather what ranks must agree on (ties,
  per-rank values), encode (compression), agree on the routing table, refuse what cannot be
  saved; the result is a :class:`SaveJob`, everything decided before a byte is written.
* **open** (:func:`open_stage`): a :class:`~unickpt.io.commit.Transaction` (temporary directory
  or token-suffixed names) and the files created at full size.
* **write** (:func:`write_stage`): each rank's :class:`~unickpt.saving.writer.RankWriter`,
  page fragments to the files' owners, copies on peer nodes.
* **commit** (:func:`commit_stage`): the ranks' reports become the manifest on rank 0, which
  publishes the checkpoint atomically.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Mapping

from .._metrics import Phases, human_bytes, log
from ..compress import Compression, prepare
from ..errors import DistributedError, StateDictError
from ..format import dtype_name
from ..io import commit as _commit
from ..io.catalog import step_of_name
from ..io.fileset import FileSet
from ..io.storage import Storage, per_node, storage_for
from ..manifest import INDEX_NAME, MANIFEST_NAME
from ..plan import LocalSummary, SavePlan, assemble, make_plan, summarize
from ..state import Entry, flatten
from ..transport import Comm, node_id
from .checks import check_density, check_replicas, gather_json, gather_rank_state
from .options import ProgressFn, SaveOptions, SaveResult
from .to_manifest import aux_entries, build_manifest, exception_report
from .writer import RankWriter, StagedBytes, encode_fragments, finish_files, step_args


__all__ = ["SaveJob", "save_entries"]

_PLAN_CACHE: list[tuple[Callable[[], Any], tuple, SavePlan]] = []  # (weak ref to the group, key, plan)
"""Plans of recent saves. The group is matched with ``is`` and held weakly: a process group kept
alive past ``destroy_process_group`` is destroyed at interpreter exit, which gloo aborts on."""
_PLAN_CACHE_MAX = 4


def save_entries(
    comm: Comm,
    flat: tuple[list[Entry], dict[str, Any]] | None,
    state_dict: Mapping[str, Any] | None,
    path,
    opts: SaveOptions,
    progress: ProgressFn | None = None,
    planned: Callable[[SavePlan], None] | None = None,
    staged: StagedBytes | None = None,
) -> SaveResult:
    """The synchronous save, from a state dict or from already flattened entries ``flat``;
    collective over ``comm`` (whose timeout bounds every wait). ``progress`` is called in
    this thread as ``progress(bytes_done, bytes_total)`` for this rank's writes, ending at
    ``(total, total)``; a callback that raises is logged once and not called again.
    ``planned(plan)`` is called once the ranks have agreed on the plan (the asynchronous
    writer learns from it where the next save should stage each tensor); an exception it
    raises is logged and does not change the save.

    ``staged`` (the asynchronous writer's): the entries' bytes are still arriving (the
    trainer copies them into staging while the save runs). Every read of an entry's bytes
    first waits for them (:class:`~unickpt.saving.writer.StagedBytes`), and the write stage
    ends by waiting for the whole copy, so a copy that fails anywhere fails the save on every
    rank."""
    job = plan_stage(comm, flat, state_dict, path, opts, staged, planned)
    txn = open_stage(job)
    try:
        report, copies = write_stage(job, txn, progress)
        reports = commit_stage(job, txn, report, copies)
    except BaseException:
        if job.dir_rank:
            txn.abort()
        raise
    return job.result(txn, reports, report)


@dataclass
class SaveJob:
    """One save as its stages see it: everything decided before the first byte is written."""

    comm: Comm
    opts: SaveOptions
    comp: Compression
    storage: Storage
    final: str
    node_local: bool  # ``{node}`` in the path: every node's directory commits its own copy
    entries: list[Entry]  # encoded (compression applied)
    json_state: dict[str, Any]
    aliases: dict
    per_rank: set
    exceptions: dict
    dropped: dict
    plan: SavePlan
    staged: StagedBytes | None
    ph: Phases
    out: FileSet | None = None  # the save's files, under the transaction's folder (open_stage)

    @property
    def dir_rank(self) -> bool:
        """Whether this rank manages a directory: the first rank of every node for node-local
        storage (its own copy of the manifest lists every node's files), else rank 0."""
        if self.node_local:
            return self.plan.nodes.index(self.plan.nodes[self.comm.rank]) == self.comm.rank
        return self.comm.rank == 0

    @cached_property
    def step_args(self) -> dict:
        """What this save adds to quantized tensors' tags (their rounding seeds)."""
        return step_args(self.plan, self.comp, self.opts)

    def result(self, txn: _commit.Transaction, reports: list[dict], mine: dict) -> SaveResult:
        total = sum(int(r.get("bytes", 0)) for r in reports)  # stored bytes (zstd files: compressed)
        ph = self.ph
        res = SaveResult(path=self.final, step=self.opts.step, files=[txn.file_name(f.name) for f in self.plan.files],
                         bytes=total, local_bytes=mine.get("bytes", 0), seconds=ph.elapsed(), phases=dict(ph.seconds))
        if self.comm.rank == 0:
            log.info("saved %s: %s in %d files, %.2f s (%.2f GB/s; plan %.2f s, write %.2f s, commit %.2f s)",
                     self.final, human_bytes(total), len(res.files), res.seconds, res.gbps, ph.seconds.get("plan", 0),
                     ph.seconds.get("write", 0), ph.seconds.get("commit", 0))
        return res


# -- plan ----------------------------------------------------------------------------------

def plan_stage(comm: Comm, flat, state_dict, path, opts: SaveOptions, staged: StagedBytes | None = None,
               planned: Callable[[SavePlan], None] | None = None) -> SaveJob:
    opts, comp = _effective(path, opts)
    ph = Phases()
    storage, final = storage_for(path, opts.storage_options)
    with ph.phase("plan"):
        entries, json_state = comm.step("save (reading the state dict)",
                                        lambda: flat if flat is not None else flatten(state_dict, comm.rank, comm.world))
        # tied weights and per-rank values: every rank's, in one exchange
        aliases, per_rank_keys, json_state = gather_rank_state(comm, entries, json_state)
        if staged is not None and comp.master != "full":  # the master policy reads the bytes: agreed on its
            comm.step("save (staging)", staged.wait_all)  # own, so a failed copy does not skip prepare's all-gather
        given = entries  # (the values as given: replicated copies are compared in these, not in their encoding)
        encoded, tags, exceptions, dropped, summary = comm.step(
            "save (compressing the master weights)", lambda: _encode(comm, entries, comp))
        plan = _agree_plan(comm, summary, opts.bucket_bytes, opts.max_file_bytes, comp.zstd, storage.caps.shared_writes,
                           comp.lossless)
        comm.step("save (tied weights, the manifest's size)", lambda: _check_ties_and_density(plan, aliases, json_state, opts))
        check_replicas(comm, plan, given, staged)
        if opts.replicas:  # copies on peer nodes: possible here? (before anything is written)
            from ..replicate import problem

            comm.agree(problem(plan, storage, path, opts.replicas), "save (replicas)")
        if planned is not None:
            try:
                planned(plan)
            except Exception as e:  # advice for later saves only: never worth failing this one
                log.warning("save: the plan callback failed: %s", e)
    return SaveJob(comm, opts, comp, storage, final, per_node(path), encoded, json_state, aliases, per_rank_keys,
                   exceptions, dropped, plan, staged, ph)


def _effective(path, opts: SaveOptions) -> tuple[SaveOptions, Compression]:
    """The step a ``step-N`` directory records (every reader checks the name against it), and
    the compression this save applies (none beyond the error budget)."""
    if opts.step is None:
        named = step_of_name(os.path.basename(os.fspath(path).rstrip("/")))
        if named is not None:
            opts = replace(opts, step=named)
    comp = opts.compression or Compression()
    if comp.quant is not None and comp.quant_for(opts.lossy_generations) is None:
        log.warning("save: the error budget is spent (the state has been through %d lossy save/resume cycles, "
                    "max_generations=%d): its moments are stored as they are (O0) this time",
                    opts.lossy_generations, comp.max_generations)
        comp = replace(comp, quant=None)
    return opts, comp


def _encode(comm: Comm, entries: list[Entry], comp: Compression):
    """Compression (collectives inside come before anything that can fail: see
    :func:`~unickpt.compress.prepare`) and this rank's summary for the plan."""
    entries, tags, exceptions, dropped = prepare(entries, comp, lambda o: gather_json(comm, o, "save (compression)"))
    summary = summarize(entries, [dtype_name(e.local.dtype) for e in entries], node_id(), tags)
    return entries, tags, exceptions, dropped, summary


def _check_ties_and_density(plan: SavePlan, aliases: dict, json_state: dict, opts: SaveOptions) -> None:
    clash = sorted(k for k in aliases if k in plan.tensors)
    if clash:
        role, name = clash[0]
        raise StateDictError(
            f"tensor {name!r} (role {role}) is tied to {aliases[clash[0]]!r} (the same memory) on some ranks "
            "and a tensor of its own on others: every rank must pass the same state dict structure")
    check_density(json_state, opts, [n for _, n in plan.tensors] + [n for _, n in aliases])


def _agree_plan(comm: Comm, summary: LocalSummary, bucket_bytes: int, max_file_bytes: int | None,
                zstd: int | None = None, shared_writes: bool = True, lossless: bool = False) -> SavePlan:
    """Exchange heads (digest and rule claims); reuse the cached plan when every rank's
    summary is unchanged, otherwise exchange the payloads (explicit rows, each rule body
    once, sent by its lowest claimant) and plan again."""
    digests = tuple(comm.all_gather_bytes(summary.head(), "save (planning: summaries' digests)"))
    from ..plan import make as _make

    key = (comm.world, digests, bucket_bytes, max_file_bytes, zstd, lossless, _make.DIRECT_MIN_RUN, shared_writes)
    plan = next((p for g, k, p in _PLAN_CACHE if g() is comm.group and k == key), None)
    # caches are per process: reuse only if every rank has the plan, so all run the same collectives
    hits = comm.all_gather_bytes(b"1" if plan is not None else b"0", "save (planning: cached plans)")
    if plan is not None and all(h == b"1" for h in hits):
        return plan
    summaries, rules = assemble(list(digests), comm.all_gather_bytes(summary.payload(list(digests), comm.rank),
                                                                   "save (planning: summaries)"))
    plan = comm.step("save (planning)", lambda: make_plan(summaries, bucket_bytes=bucket_bytes, zstd=zstd, rules=rules,
                                                          max_file_bytes=max_file_bytes, shared_writes=shared_writes,
                                                          lossless=lossless))
    if len(_PLAN_CACHE) >= _PLAN_CACHE_MAX:
        _PLAN_CACHE.pop(0)
    _PLAN_CACHE.append((_weak(comm.group), key, plan))
    return plan


def _weak(group: Any) -> Callable[[], Any]:
    if group is None:
        return lambda: None
    return weakref.ref(group)


# -- open ----------------------------------------------------------------------------------

def open_stage(job: SaveJob) -> _commit.Transaction:
    """The transaction (one token, from rank 0) and this save's files, created at full size
    by their owners so holders can write in place."""
    comm = job.comm
    token = comm.broadcast_bytes(_commit.new_token().encode() if comm.rank == 0 else None,
                                 what="save (the transaction's token)").decode()
    txn = _commit.Transaction(job.storage, job.final, overwrite=job.opts.overwrite, token=token, step=job.opts.step,
                              timeout_s=comm.timeout_s)
    comm.step("save (preparing the directory)", lambda: txn.begin() if job.dir_rank else None)
    job.out = FileSet(job.storage, txn.tmp, txn.file_name)
    try:
        with job.ph.phase("create"):
            comm.step("save (creating files)", lambda: _create_files(job, txn))
    except BaseException:
        if job.dir_rank:
            txn.abort()
        raise
    return txn


def _create_files(job: SaveJob, txn: _commit.Transaction) -> None:
    for f in job.plan.files_of(job.comm.rank):
        job.out.create(f.name, f.size, f.framed)


# -- write ---------------------------------------------------------------------------------

def write_stage(job: SaveJob, txn: _commit.Transaction, progress: ProgressFn | None) -> tuple[dict, dict]:
    """Every rank's writes, then the page fragments at the edges of O_DIRECT runs to the files'
    owners, then copies on peer nodes (before the commit: a committed copy is a complete one).
    Returns this rank's report for the manifest and the copies made."""
    comm, ph = job.comm, job.ph
    with ph.phase("write"):
        report, fragments = comm.step("save (writing)", lambda: _write(job, txn, progress))
        with ph.phase("finish"):
            blobs = comm.all_gather_bytes(encode_fragments(fragments), "save (page fragments)")
            comm.step("save (writing)", lambda: finish_files(job.plan, comm.rank, job.out, blobs))
    copies: dict[str, list[str]] = {}
    if job.opts.replicas:
        with ph.phase("replicate"):
            from ..replicate import replicate

            copies = replicate(comm, job.plan, job.storage, txn.tmp, txn.file_name, job.opts.replicas, job.dir_rank)
    return report, copies


def _write(job: SaveJob, txn: _commit.Transaction, progress: ProgressFn | None) -> tuple[dict, list]:
    try:
        writer = RankWriter(job.plan, job.comm, job.entries, job.out, direct_io=job.opts.direct_io, phase=job.ph.phase,
                            progress=progress, staged=job.staged, step_args=job.step_args)
        report, fragments = writer.run()
        if job.staged is not None:  # bytes this rank did not need (another rank writes them) too:
            job.staged.wait_all()  # a copy that failed anywhere fails the save
        report["exceptions"] = exception_report(job.plan, job.comm.rank, job.exceptions)
        return report, fragments
    finally:
        job.storage.close()


# -- commit --------------------------------------------------------------------------------

def commit_stage(job: SaveJob, txn: _commit.Transaction, report: dict, copies: dict) -> list[dict]:
    """The manifest (rank 0's, from every rank's report; node-local: the same in every node's
    directory), the index and extra files, then the atomic publish. Returns the reports."""
    comm = job.comm
    with job.ph.phase("commit"):
        reports = [json.loads(r) for r in comm.all_gather_bytes(json.dumps(report).encode(),
                                                                "save (reports for the manifest)")]
        blob, idx = comm.step("save (manifest)",
                              lambda: _manifest(job, txn, reports, copies) if comm.rank == 0 else (b"", None))
        extra_files = dict(job.opts.extra_files or {})
        if job.node_local:  # rank 0's, which the manifest records (a node's own would fail its checks)
            blob = comm.broadcast_bytes(blob if comm.rank == 0 else None, what="save (the manifest)")
            idx = comm.broadcast_bytes((idx or b"") if comm.rank == 0 else None, what="save (the index)") or None
            extra_files = json.loads(comm.broadcast_bytes(json.dumps(extra_files).encode() if comm.rank == 0 else None,
                                                          what="save (the extra files)"))
        comm.step("save (writing the manifest)",
                  lambda: _put_side_files(job, txn, blob, idx, extra_files) if job.dir_rank else None)
        _publish(job, txn, blob)
    return reports


def _manifest(job: SaveJob, txn: _commit.Transaction, reports: list[dict], copies: dict) -> tuple[bytes, bytes | None]:
    opts = job.opts
    man = build_manifest(job.plan, reports, opts.step, job.json_state, dict(opts.extra or {}), dict(opts.strategy or {}),
                         job.dropped, job.comp, txn.file_name, opts.lossy_generations, job.step_args)
    man.aliases = job.aliases
    man.per_rank = job.per_rank
    for name, nodes in copies.items():
        man.files[txn.file_name(name)] = replace(man.files[txn.file_name(name)], replicas=tuple(nodes))
    idx = man.hf_index()
    man.aux = aux_entries({INDEX_NAME: idx} if idx is not None else {}, opts.extra_files)
    return man.to_json(), idx


def _put_side_files(job: SaveJob, txn: _commit.Transaction, blob: bytes, idx: bytes | None,
                    extra_files: dict[str, str]) -> None:
    if idx is not None:
        txn.put(INDEX_NAME, idx)
    for n, text in extra_files.items():
        txn.put(n, text.encode())
    if job.node_local and not txn.marker:  # (a rename commits; on object stores the
        txn.put(MANIFEST_NAME, blob)  # manifest is the commit marker, put by commit)


def _publish(job: SaveJob, txn: _commit.Transaction, blob: bytes) -> None:
    """Commit (every directory rank; node-local: manifests are everywhere already). Written
    out rather than as a :meth:`~unickpt.transport.Comm.step`: a rank whose own part
    succeeded says that the outcome is unknown, not that nothing was committed."""
    err: BaseException | None = None
    committed = False
    if job.dir_rank:
        try:
            txn.commit(None if job.node_local and not txn.marker else blob)
            committed = True
        except Exception as e:
            err = e
    try:
        job.comm.agree(err, "save (commit)")
    except DistributedError as e:
        if err is None:  # this rank's part succeeded: the checkpoint may well be committed
            raise DistributedError(
                f"{e}; the commit's outcome is unknown here: {job.final} "
                f"{'was committed by this rank' if committed else 'may or may not be committed'} "
                "(check unickpt.latest() or read_manifest before relying on it)") from e
        raise
