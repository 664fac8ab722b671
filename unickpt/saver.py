"""Save: plan -> gather -> encode -> write -> commit.

Every rank flattens its state dict, the ranks agree on a routing table (plan), pieces travel
to their writer in bounded buckets, writers stream whole tensors into safetensors files in
a temporary directory (fsynced, checksummed), and rank 0 commits: manifest last, then an
atomic rename. Any failure on any rank surfaces on every rank and nothing becomes visible.

:func:`save_entries` is the pipeline, run by the caller (synchronous ``unickpt.save``) or by
an asynchronous writer process (:mod:`unickpt.async_save`); :class:`SaveOptions` is every
option it takes, checked once. The public ``unickpt.save`` lives in :mod:`unickpt.api`, which
picks between the two: this module imports neither.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import operator
import os
import re
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Protocol

import torch
import xxhash

from . import commit as _commit
from ._copy import as_bytes, copy_runs
from ._metrics import Phases, gbps, human_bytes, log
from .errors import DistributedError, InvalidArgumentError, StateDictError, UnickptError
from .format import BlockHasher, Hasher, block_sums, dtype_name, torch_dtype
from .container import ZstdWriter
from .catalog import step_of_name
from .compress import EXCEPTION_WARN, Compression, encode_chunk, error_record, merge_error, prepare, save_args
from .manifest import DENSE_ALLOWANCE, INDEX_NAME, MANIFEST_NAME, FileEntry, Manifest, Part, TensorEntry, density_problem
from .plan import LocalSummary, SavePlan, Step, assemble, extents_of, make_plan, summarize
from .state import PER_RANK_KEY, RANK_VALUE_KEY, Entry, _is_json, flatten, from_json, to_json
from .storage import Storage, per_node, storage_for
from .transport import Comm, node_id, resolve_timeout

__all__ = ["SaveOptions", "SaveResult", "save_entries"]

DEFAULT_BUCKET = 256 << 20
_EXTRA_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_PLAN_CACHE: dict[tuple, SavePlan] = {}
_PLAN_CACHE_MAX = 4


@dataclass(frozen=True)
class SaveResult:
    """What a save did. Sizes are of the whole checkpoint; ``local_bytes`` is this rank's share."""

    path: str
    step: int | None
    files: list[str]
    bytes: int
    local_bytes: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return gbps(self.bytes, self.seconds)


ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """The options of :func:`unickpt.save` / :func:`unickpt.save_async` beyond the state, the
    path and the step; every one reaches the save's writer: this process's (synchronous) or
    the rank's asynchronous writer process (as :meth:`to_json`, rebuilt by :meth:`from_json`).

    Checked when built (``__post_init__``), so no invalid instance exists: bad input raises
    :class:`~unickpt.errors.StateDictError` (``step``, ``extra``, ``strategy``,
    ``extra_files``) or :class:`~unickpt.errors.InvalidArgumentError` (the rest), the same
    whether the save is synchronous or not, before anything is staged or written. Frozen:
    fields cannot be reassigned, and the mapping fields are private copies (a caller's later
    change to its dicts does not reach a save in flight). :meth:`of` builds one from
    ``unickpt.save``'s keywords (``quant``/``master``/``zstd`` or ``compression``).
    ``storage_options`` (fsspec options of a URL path, possibly credentials) stay out of
    ``repr``.
    """

    step: int | None = None
    """Recorded in the manifest (``save(step=...)`` sets it; a ``step-N`` path records N)."""
    compression: Compression | None = None
    """O1/O2 moments, residual or dropped masters, zstd (:class:`~unickpt.Compression`,
    docs/compression.md); None: nothing compressed (an inactive one becomes None)."""
    overwrite: bool = False
    """Replace a committed checkpoint at the path (atomically: the old one stays loadable until
    the new one commits)."""
    extra: Mapping[str, Any] | None = None
    """JSON state stored in the manifest's ``extra`` (``LoadResult.extra``): rank 0's."""
    extra_files: Mapping[str, str] | None = None
    """Small text files (``{"config.json": ...}``) written into the checkpoint before the
    commit, listed and checksummed in the manifest: rank 0's."""
    strategy: Mapping[str, Any] | None = None
    """Free-form description of the saving layout, stored for information: rank 0's."""
    timeout_s: float | None = None
    """Seconds a rank waits for the others in any one exchange before the save fails with
    :class:`~unickpt.errors.DistributedError` (None: ``UNICKPT_TIMEOUT_S``, else 600); the
    commit lock is waited for at most 0.8 x this."""
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """For a URL path: options of its file system (credentials, endpoint...; docs/storage.md),
    JSON values (they travel to the asynchronous writer). Never shown in reprs or logs."""
    bucket_bytes: int = DEFAULT_BUCKET
    """Bound on the bytes a writer assembles at once (default 256 MiB)."""
    max_file_bytes: int | None = None
    """Split a writer's files of one role beyond this size."""
    direct_io: bool | None = None
    """Write with O_DIRECT (None: where the file system supports it)."""
    replicas: int = 0
    """Node-local saves (``{node}`` in the path): each node's data files are also written
    into the directories of this many other nodes before the commit (the memory tier's
    replication); at most the number of other nodes."""
    lossy_generations: int = 0
    """Lossy save/resume cycles the state being saved has been through
    (``LoadResult.lossy_generations`` of the load that restored it; 0 for a fresh state). A
    quantized save records one more in each quantized tensor's entry and in the manifest,
    and ``Compression.max_generations`` is checked against it (the error budget)."""

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.step is not None and type(self.step) is not int:
            raise StateDictError(f"step must be an int or None, got {type(self.step).__name__} {self.step!r}")
        if self.step is not None and not -(1 << 63) <= self.step < 1 << 63:
            raise StateDictError(f"step must be an int (64-bit) or None, got an int of {self.step.bit_length()} bits")
        if self.step is not None and self.step < 0:
            raise StateDictError(f"step must be an int >= 0 or None, got {self.step}")
        for name, what in (("extra", "(None, bool, int, float, str, lists, dicts)"), ("strategy", "")):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, Mapping) or not _is_json(v):
                    raise StateDictError(f"{name} must be a JSON-serialisable dict {what}".rstrip())
                put(name, to_json(v, name))  # a private copy, checked (text, integers, nesting, reserved keys)
        if self.extra_files is not None:
            if not isinstance(self.extra_files, Mapping):
                raise StateDictError(f"extra_files must be a dict of name -> text, got {type(self.extra_files).__name__}")
            for n, text in self.extra_files.items():
                if (not isinstance(n, str) or not _EXTRA_FILE.fullmatch(n) or n in (MANIFEST_NAME, INDEX_NAME)
                        or n.endswith(".safetensors") or not isinstance(text, str)):
                    raise StateDictError(
                        f"extra file {n!r}: use a bare name like 'config.json' (not a manifest, index or "
                        ".safetensors name) with str content"
                    )
                to_json(text, f"extra file {n}")  # (text that is valid Unicode)
            put("extra_files", dict(self.extra_files))
        if type(self.overwrite) is not bool:
            raise InvalidArgumentError(f"overwrite must be True or False, got {self.overwrite!r}")
        if self.direct_io is not None and type(self.direct_io) is not bool:
            raise InvalidArgumentError(f"direct_io must be None, True or False, got {self.direct_io!r}")
        put("bucket_bytes", _whole("bucket_bytes", self.bucket_bytes, 4096))
        if self.max_file_bytes is not None:
            put("max_file_bytes", _whole("max_file_bytes", self.max_file_bytes, 1))
        comp = self.compression
        if comp is not None:
            if isinstance(comp, Mapping):  # from to_json()
                try:
                    comp = Compression.coerce(dict(comp))
                except (TypeError, ValueError) as e:
                    raise InvalidArgumentError(f"compression: {e}") from None
            elif not isinstance(comp, Compression):
                raise InvalidArgumentError(
                    f"compression must be a unickpt.Compression or None, got {type(comp).__name__} {comp!r}")
            put("compression", comp if comp.active else None)
        if self.timeout_s is not None:
            put("timeout_s", resolve_timeout(self.timeout_s))
        put("replicas", _whole("replicas", self.replicas, 0))
        put("lossy_generations", _whole("lossy_generations", self.lossy_generations, 0))
        if self.lossy_generations >= MAX_GENERATIONS:
            raise InvalidArgumentError(f"lossy_generations must be below {MAX_GENERATIONS} (a save adds one, and "
                                       f"manifests hold counts below 2^31), got {self.lossy_generations}")
        if self.compression is not None:  # the error budget: "refuse" raises here, before anything is written
            self.compression.quant_for(self.lossy_generations)
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping) or not _is_json(self.storage_options):
                raise InvalidArgumentError(
                    "storage_options must be a dict with str keys and JSON values (str, numbers, bools, lists, "
                    "dicts): they travel to the asynchronous writer process as JSON")
            try:  # a private copy, checked (nesting, text, huge integers: an argument's problem, not the state's)
                put("storage_options", to_json(self.storage_options, "storage_options"))
            except StateDictError as e:
                raise InvalidArgumentError(str(e)) from None

    @classmethod
    def of(cls, *, quant: str | None = None, master: str | None = None, zstd: int | None = None,
           compression: Compression | None = None, **kw) -> "SaveOptions":
        """Checked options from ``unickpt.save``'s keywords: ``quant``/``master``/``zstd``
        or ``compression`` (not both), and the fields of this class."""
        if compression is None and any(v is not None for v in (quant, master, zstd)):
            try:
                compression = Compression.coerce(None, quant=quant, master=master, zstd=zstd)
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(str(e)) from None
        elif any(v is not None for v in (quant, master, zstd)):
            raise InvalidArgumentError("pass either compression=Compression(...) or quant/master/zstd, not both")
        return cls(compression=compression, **kw)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the command sent to an asynchronous writer); see :meth:`from_json`."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["compression"] = self.compression.to_json() if self.compression is not None else None
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SaveOptions":
        """The options :meth:`to_json` gave, checked again."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidArgumentError(f"unknown save options {sorted(unknown)}")
        return cls(**d)


MAX_GENERATIONS = (1 << 31) - 1
"""Bound of ``SaveOptions.lossy_generations``: the count after a lossy save stays below 2^31."""

def _whole(name: str, v: Any, lo: int) -> int:
    if not isinstance(v, bool):
        try:
            n = operator.index(v)
        except TypeError:
            n = None
        if n is not None and n >= lo:
            return n
    raise InvalidArgumentError(f"{name} must be an integer of at least {lo}, got {v!r}")


def save_entries(
    comm: Comm,
    flat: tuple[list[Entry], dict[str, Any]] | None,
    state_dict: Mapping[str, Any] | None,
    path,
    opts: SaveOptions,
    progress: ProgressFn | None = None,
    planned: Callable[[SavePlan], None] | None = None,
    staged: "StagedBytes | None" = None,
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
    first waits for them (:class:`StagedBytes`), and the write phase ends by waiting for
    the whole copy, so a copy that fails anywhere fails the save on every rank."""
    if opts.step is None:  # a step-N directory records step N (every reader checks the name against it)
        named = step_of_name(os.path.basename(os.fspath(path).rstrip("/")))
        if named is not None:
            opts = replace(opts, step=named)
    comp = opts.compression or Compression()
    if comp.quant is not None and comp.quant_for(opts.lossy_generations) is None:
        log.warning("save: the error budget is spent (the state has been through %d lossy save/resume cycles, "
                    "max_generations=%d): its moments are stored as they are (O0) this time",
                    opts.lossy_generations, comp.max_generations)
        comp = replace(comp, quant=None)
    ph = Phases()
    storage, final = storage_for(path, opts.storage_options)
    err: BaseException | None = None
    entries: list[Entry] = []
    json_state: dict[str, Any] = {}
    with ph.phase("plan"):
        try:
            entries, json_state = flat if flat is not None else flatten(state_dict, comm.rank, comm.world)
        except Exception as e:
            err = e
        comm.agree(err, "save (reading the state dict)")
        # tied weights and per-rank values: every rank's, in one exchange (also when a rank's
        # state dict failed above: the others already raised, this one too)
        aliases, per_rank_keys, json_state = _gather_rank_state(comm, entries, json_state)
        tags, exceptions, dropped = {}, {}, {}
        if staged is not None and comp.master != "full":  # the master policy reads the bytes
            try:  # agreed on its own: a rank whose copy failed must not skip prepare's all-gather
                staged.wait_all()
            except Exception as e:
                err = e
            comm.agree(err, "save (staging)")
        given = entries  # (the values as given: replicated copies are compared in these, not in their encoding)
        try:  # collectives inside come before anything that can fail (see compress.prepare)
            entries, tags, exceptions, dropped = prepare(entries, comp, lambda o: _gather_json(comm, o, "save (compression)"))
            dtypes = [dtype_name(e.local.dtype) for e in entries]
            summary = summarize(entries, dtypes, node_id(), tags)  # rules where layouts have them
        except Exception as e:
            err = e
        comm.agree(err, "save (compressing the master weights)")
        plan = _agree_plan(comm, summary, opts.bucket_bytes, opts.max_file_bytes, comp.zstd,
                           storage.caps.shared_writes)
        err = None
        try:
            clash = sorted(k for k in aliases if k in plan.tensors)
            if clash:
                role, name = clash[0]
                raise StateDictError(
                    f"tensor {name!r} (role {role}) is tied to {aliases[clash[0]]!r} (the same memory) on some ranks "
                    "and a tensor of its own on others: every rank must pass the same state dict structure")
            _check_density(json_state, opts, [n for _, n in plan.tensors] + [n for _, n in aliases])
        except Exception as e:
            err = e
        comm.agree(err, "save (tied weights, the manifest's size)")
        _check_replicas(comm, plan, given, staged)
        if opts.replicas:  # copies on peer nodes: possible here? (before anything is written)
            from .replicate import problem

            comm.agree(problem(plan, storage, path, opts.replicas), "save (replicas)")
        if planned is not None:
            try:
                planned(plan)
            except Exception as e:  # advice for later saves only: never worth failing this one
                log.warning("save: the plan callback failed: %s", e)

    # -- prepare the temporary directory ------------------------------------------------
    token = comm.broadcast_bytes(_commit.new_token().encode() if comm.rank == 0 else None,
                                 what="save (the transaction's token)").decode()
    txn = _commit.Transaction(storage, final, overwrite=opts.overwrite, token=token, step=opts.step,
                              timeout_s=comm.timeout_s)
    tmp = txn.tmp
    # node-local storage ({node} in the path): the first rank of every node manages that
    # node's directory (its own copy of the manifest lists every node's files); else rank 0
    if per_node(path):
        dir_rank = plan.nodes.index(plan.nodes[comm.rank]) == comm.rank
    else:
        dir_rank = comm.rank == 0
    if dir_rank:
        try:
            txn.begin()
        except Exception as e:
            err = e
    comm.agree(err, "save (preparing the directory)")

    # -- gather + write ------------------------------------------------------------------
    by_key = {e.key: e for e in entries}
    result: dict = {}
    try:
        with ph.phase("create"):
            try:  # owners create their files at full size, so holders can write in place
                for f in plan.files_of(comm.rank):
                    storage.create_file(storage.join(tmp, txn.file_name(f.name)), 0 if f.zstd else f.size)
            except Exception as e:
                err = e
            comm.agree(err, "save (creating files)")
            _commit._fault_point("after-create")
        with ph.phase("write"):
            try:
                result, fragments = _write_rank(plan, comm, by_key, storage, tmp, opts.direct_io, ph, progress,
                                                txn.file_name, staged, _step_args(plan, comp, opts))
                if staged is not None:  # bytes this rank did not need (another rank writes them) too:
                    staged.wait_all()  # a copy that failed anywhere fails the save
                result["exceptions"] = _exception_report(plan, comm.rank, exceptions)
            except Exception as e:  # agreed below: no rank leaves the others waiting
                err, fragments = e, []
            finally:
                storage.close()
            with ph.phase("finish"):
                # partial pages at the edges of O_DIRECT runs go to the file's owner
                blobs = comm.all_gather_bytes(_encode_fragments(fragments), "save (page fragments)")
                if err is None:
                    try:
                        _finish_files(plan, comm.rank, storage, tmp, blobs, txn.file_name)
                    except Exception as e:
                        err = e
        comm.agree(err, "save (writing)")
        copies: dict[str, list[str]] = {}
        if opts.replicas:
            with ph.phase("replicate"):  # before the commit: a committed copy is a complete one
                from .replicate import replicate

                copies = replicate(comm, plan, storage, tmp, txn.file_name, opts.replicas, dir_rank)
        _commit._fault_point("after-data")
        with ph.phase("commit"):
            reports = [json.loads(r) for r in comm.all_gather_bytes(json.dumps(result).encode(), "save (reports for the manifest)")]
            blob, idx = b"", None
            if comm.rank == 0:
                try:
                    man = _manifest(plan, reports, opts.step, json_state, dict(opts.extra or {}), dict(opts.strategy or {}),
                                    dropped, comp, txn.file_name, opts.lossy_generations, _step_args(plan, comp, opts))
                    man.aliases = aliases
                    man.per_rank = per_rank_keys
                    for name, nodes in copies.items():
                        man.files[txn.file_name(name)] = replace(man.files[txn.file_name(name)], replicas=tuple(nodes))
                    idx = man.hf_index()
                    man.aux = _aux({INDEX_NAME: idx} if idx is not None else {}, opts.extra_files)
                    blob = man.to_json()
                except Exception as e:
                    err = e
            comm.agree(err, "save (manifest)")
            extra_files = dict(opts.extra_files or {})
            if per_node(path):  # every node's directory gets the same manifest, index and extra files
                blob = comm.broadcast_bytes(blob if comm.rank == 0 else None, what="save (the manifest)")
                idx = comm.broadcast_bytes((idx or b"") if comm.rank == 0 else None, what="save (the index)") or None
                # rank 0's, which the manifest records (a node's own would fail its checks)
                extra_files = json.loads(comm.broadcast_bytes(json.dumps(extra_files).encode() if comm.rank == 0 else None,
                                                              what="save (the extra files)"))
            if dir_rank:
                try:
                    if idx is not None:
                        txn.put(INDEX_NAME, idx)
                    for n, text in extra_files.items():
                        txn.put(n, text.encode())
                    if per_node(path) and not txn.marker:  # (a rename commits; on object stores the
                        txn.put(MANIFEST_NAME, blob)  # manifest is the commit marker, put by commit)
                except Exception as e:
                    err = e
            comm.agree(err, "save (writing the manifest)")
            _commit._fault_point("before-commit")
            committed = False
            if dir_rank:  # (node-local: manifests are everywhere, now every node's directory commits)
                try:
                    txn.commit(None if per_node(path) and not txn.marker else blob)
                    committed = True
                except Exception as e:
                    err = e
            try:
                comm.agree(err, "save (commit)")
            except DistributedError as e:
                if err is None:  # this rank's part succeeded: the checkpoint may well be committed
                    raise DistributedError(
                        f"{e}; the commit's outcome is unknown here: {final} "
                        f"{'was committed by this rank' if committed else 'may or may not be committed'} "
                        "(check unickpt.latest() or read_manifest before relying on it)") from e
                raise
    except BaseException:
        if dir_rank:
            txn.abort()
        raise

    total = sum(int(r.get("bytes", 0)) for r in reports)  # stored bytes (zstd files: compressed)
    res = SaveResult(
        path=final,
        step=opts.step,
        files=[txn.file_name(f.name) for f in plan.files],
        bytes=total,
        local_bytes=result.get("bytes", 0),
        seconds=ph.elapsed(),
        phases=dict(ph.seconds),
    )
    if comm.rank == 0:
        log.info(
            "saved %s: %s in %d files, %.2f s (%.2f GB/s; plan %.2f s, write %.2f s, commit %.2f s)",
            final, human_bytes(total), len(res.files), res.seconds, res.gbps,
            ph.seconds.get("plan", 0), ph.seconds.get("write", 0), ph.seconds.get("commit", 0),
        )
    return res


def _aux(files: Mapping[str, bytes], extra_files: Mapping[str, str] | None) -> dict[str, tuple[int, str]]:
    """Size and checksum of the checkpoint's other files (index, extra files), for the manifest."""
    out = {n: (len(b), Hasher.of(b)) for n, b in files.items()}
    for n, text in (extra_files or {}).items():
        b = text.encode()
        out[n] = (len(b), Hasher.of(b))
    return out


def _agree_plan(comm: Comm, summary: LocalSummary, bucket_bytes: int, max_file_bytes: int | None,
                zstd: int | None = None, shared_writes: bool = True) -> SavePlan:
    """Exchange heads (digest and rule claims); reuse the cached plan when every rank's
    summary is unchanged, otherwise exchange the payloads (explicit rows, each rule body
    once, sent by its lowest claimant) and plan again."""
    digests = tuple(comm.all_gather_bytes(summary.head(), "save (planning: summaries' digests)"))
    from . import plan as _plan

    key = (id(comm.group), comm.world, digests, bucket_bytes, max_file_bytes, zstd, _plan.DIRECT_MIN_RUN, shared_writes)
    plan = _PLAN_CACHE.get(key)
    # caches are per process: reuse only if every rank has the plan, so all run the same collectives
    hits = comm.all_gather_bytes(b"1" if plan is not None else b"0", "save (planning: cached plans)")
    if plan is not None and all(h == b"1" for h in hits):
        return plan
    summaries, rules = assemble(list(digests), comm.all_gather_bytes(summary.payload(list(digests), comm.rank),
                                                                   "save (planning: summaries)"))
    err = None
    try:
        plan = make_plan(summaries, bucket_bytes=bucket_bytes, max_file_bytes=max_file_bytes, zstd=zstd,
                         shared_writes=shared_writes, rules=rules)
    except UnickptError as e:
        err = e
    comm.agree(err, "save (planning)")
    if len(_PLAN_CACHE) >= _PLAN_CACHE_MAX:
        _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[key] = plan
    return plan


def _check_density(json_state: dict[str, Any], opts: SaveOptions, names: list[str]) -> None:
    """Refuse JSON state (with ``extra``, ``strategy`` and the tensor names, which the
    manifest writes more than once) that its manifest could not hold: more objects and arrays
    than a manifest reader parses for its size (:func:`unickpt.manifest.density_problem`),
    before anything is written. Half the allowance, leaving the other half to the manifest's
    own entries (the same on every rank: the plan and the gathered state are)."""
    text = json.dumps([json_state, opts.extra, opts.strategy], separators=(",", ":"), ensure_ascii=False).encode()
    brackets = sum(n.count("{") + n.count("[") for n in names)
    why = density_problem(text, DENSE_ALLOWANCE // 2, (brackets * 3, sum(len(n) + 3 for n in names) * 3))
    if why:
        raise StateDictError(f"the JSON state and tensor names hold {why}: more than a checkpoint's manifest may hold "
                             "for its size (it bounds what loads parse). Store long lists of small lists or dicts (seen "
                             "sample ids, token counts...) in a tensor")


def _gather_rank_state(comm: Comm, entries: list[Entry], json_state: dict[str, Any]):
    """Every rank's tied-weight aliases and per-rank keys (merged), and the JSON state with
    each :func:`~unickpt.per_rank` value replaced by the list of every rank's value. One
    exchange of small JSON; the result is the same on every rank."""
    mine_al = sorted([e.role, a, e.name] for e in entries for a in e.aliases)
    mine_pr = sorted([e.role, e.name, list(e.layout.shape[1:]), dtype_name(e.local.dtype)] for e in entries if e.per_rank)
    values: list = []
    _rank_values(json_state, values.append)
    common = _rank_values(json_state, None, lambda v: None)  # what must be the same on every rank
    digest = xxhash.xxh3_64_hexdigest(json.dumps(common, sort_keys=True, separators=(",", ":")).encode())
    everyone = _gather_json(comm, {"al": mine_al, "pr": mine_pr, "v": values, "h": digest}, "save (per-rank values)")
    if len({x["h"] for x in everyone}) > 1:  # JSON values differ between ranks: find one to name
        states = _gather_json(comm, common, "save (per-rank values differ)")
        path, r, absent, lens = _first_difference([from_json(x) for x in states])
        if lens is not None:
            raise StateDictError(
                f"the JSON list {path!r} holds {lens[0]} item(s) on rank 0 and {lens[1]} on rank {r}: JSON values are "
                "saved once for all ranks, so every rank passes the same structure (the same number of param_groups, "
                "say); wrap values that differ per rank in unickpt.per_rank(...)")
        if absent is not None:  # one rank holds a value the other has no place for: structure, not values
            has = 0 if absent == r else r
            raise StateDictError(
                f"rank {has} holds the JSON value {path!r} and rank {absent} does not: every rank passes the same "
                "structure, with its own pieces of the tensors. A state dict only rank 0 fills (get_state_dict with "
                "full_state_dict=True and cpu_offload=True gives the others {}) is saved by rank 0 alone: "
                "unickpt.save(..., group=\"local\") there; or save the sharded state dict from every rank")
        raise StateDictError(
            f"the JSON value {path!r} differs between ranks (rank 0 and rank {r}): JSON values are saved once for all "
            "ranks. Wrap values that differ per rank (data positions, per-rank counters) in unickpt.per_rank(...), or "
            "make the ranks agree before saving")
    aliases: dict[tuple[str, str], str] = {}
    for r, x in enumerate(everyone):
        for role, alias, name in x["al"]:
            if aliases.setdefault((role, alias), name) != name:
                raise StateDictError(f"tensor {alias!r} (role {role}) is tied to {aliases[(role, alias)]!r} on one rank "
                                     f"and to {name!r} on rank {r}: every rank must tie the same weights")
    seen: dict[tuple[str, str], tuple[int, list, str]] = {}
    for r, x in enumerate(everyone):
        for role, name, shape, dt in x["pr"]:
            first = seen.setdefault((role, name), (r, shape, dt))
            if (first[1], first[2]) != (shape, dt):
                raise StateDictError(
                    f"per_rank tensor {name!r} (role {role}) must have the same shape and dtype on every rank: rank "
                    f"{first[0]} has {first[2]} {first[1]}, rank {r} has {dt} {shape} (pad it to one shape, or store "
                    "the value as JSON)")
    per_rank_keys = set(seen)
    counts = {len(x["v"]) for x in everyone}
    if len(counts) > 1:
        raise StateDictError(f"the ranks hold different numbers of per_rank() values ({sorted(counts)}): every rank "
                             "must pass the same state dict structure")
    if values:
        it = iter(range(len(values)))

        def gathered(_v):
            i = next(it)
            return {PER_RANK_KEY: [x["v"][i] for x in everyone]}

        json_state = _rank_values(json_state, None, gathered)
    return aliases, per_rank_keys, json_state


def _first_difference(states: list) -> tuple[str, int, int | None, tuple[int, int] | None]:
    """The first path (dotted) where a rank's JSON state differs from rank 0's, that rank,
    the rank whose state lacks the path (None: both hold something there), and the lengths
    of two lists that differ in length there (None: not that)."""
    found: dict = {}

    def diff(a, b, where: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in a or k not in b:
                    found["absent"] = 0 if k not in a else -1
                    return f"{where}.{k}" if where else k
                d = diff(a[k], b[k], f"{where}.{k}" if where else k)
                if d is not None:
                    return d
            return None
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                found["lens"] = (len(a), len(b))
                return where or "<state>"
            for i, (x, y) in enumerate(zip(a, b)):
                d = diff(x, y, f"{where}.{i}" if where else str(i))
                if d is not None:
                    return d
            return None
        if isinstance(a, float) and isinstance(b, float):  # as stored: NaN is NaN, -0.0 is not 0.0
            same = (a == b and math.copysign(1, a) == math.copysign(1, b)) or (a != a and b != b)
        else:
            same = a == b and type(a) is type(b)
        return None if same else (where or "<state>")

    for r, st in enumerate(states[1:], 1):
        found.clear()
        d = diff(states[0], st, "")
        if d is not None:
            absent = found.get("absent")
            return d, r, (r if absent == -1 else absent), found.get("lens")
    return "<state>", 1, None, None


def _rank_values(obj: Any, visit=None, replace=None) -> Any:
    """Walk JSON state in a fixed order: ``visit(value)`` each per-rank value, or return a
    copy with each ``{RANK_VALUE_KEY: v}`` replaced by ``replace(v)``."""
    if isinstance(obj, dict):
        if RANK_VALUE_KEY in obj and len(obj) == 1:
            if visit is not None:
                visit(obj[RANK_VALUE_KEY])
            return replace(obj[RANK_VALUE_KEY]) if replace is not None else obj
        return {k: _rank_values(v, visit, replace) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rank_values(v, visit, replace) for v in obj]
    return obj


def _on_device(t: torch.Tensor) -> bool:
    """Whether :func:`_fingerprint` takes ``t``'s fingerprint where it is, as a weighted sum
    (a tensor on an accelerator) rather than with xxh3 on the host."""
    return t.device.type != "cpu"


def _fingerprint(t: torch.Tensor, weighted: bool = False) -> int:
    """A 62-bit fingerprint of a tensor's bytes: xxh3 on the host; on an accelerator (or with
    ``weighted``, on the host too) a position-weighted sum computed where the tensor is (no
    copy of it to the host). The two differ: compare fingerprints of one kind only."""
    if not weighted and not _on_device(t):
        import xxhash

        return xxhash.xxh3_64_intdigest(as_bytes(t.detach().contiguous()).numpy()) & ((1 << 62) - 1)
    x = t.detach().contiguous().view(-1)
    b = x.view(torch.uint8)
    if b.numel() % 4 == 0:
        if b.storage_offset() % 4:  # (a view at an odd offset: the same bytes, aligned)
            b = b.clone()
        words = b.view(torch.int32)
    else:
        words = b
    h = torch.zeros((), dtype=torch.int64, device=t.device)
    step = 1 << 24
    for i in range(0, words.numel(), step):
        w = words[i:i + step].to(torch.int64)
        pos = torch.arange(i, i + w.numel(), device=t.device, dtype=torch.int64)
        h = h + (w * (pos * 2654435761 % 4294967291 + 1)).sum() + (w ^ pos).sum()
    return int(h.item()) & ((1 << 62) - 1)


def _check_replicas(comm: Comm, plan: SavePlan, entries: list[Entry], staged: "StagedBytes | None" = None) -> None:
    """Refuse a save where ranks that each present a block as the saved copy (replica 0)
    hold different values in it: one rank's copy would be stored, which one changing from
    run to run. Such blocks are plain tensors (full on every rank) and the blocks the plan
    made copies of (:attr:`~unickpt.plan.TensorPlan.copies`: DTensors on a sub-mesh under
    DDP). A fingerprint of each, with one all-reduce; the error is raised on every rank.
    Copies marked ``replica > 0`` by their layout are the caller's word and not compared.

    Each holder fingerprints its block where it lies (:func:`_fingerprint`: xxh3 on the host,
    a weighted sum on an accelerator). The same all-reduce tells whether the holders of a block
    have it on the host and on accelerators both; only those blocks take a second round, every
    holder using the weighted sum."""
    groups = _replica_groups(plan)
    if not groups or comm.world == 1:
        return
    by_key: dict[tuple[str, str], list[Entry]] = {}
    for e in entries:
        by_key.setdefault(e.key, []).append(e)
    hi = 1 << 62
    n = len(groups)
    # per group: the fingerprint, its negation (max over holders as min(-v)), the device kind
    # (0 host, 1 accelerator) and its negation; hi for ranks that do not hold the block
    words = torch.full((4, n), hi, dtype=torch.int64)
    mine: dict[int, Entry] = {}
    err: BaseException | None = None
    try:
        for i, (k, box, ranks) in enumerate(groups):
            if box is None:
                held = [e for e in by_key.get(k, ()) if e.layout.replica == 0 and e.layout.is_full]
            else:  # (the plan marked all but the first a copy; the entry keeps the rank's own word)
                held = [e for e in by_key.get(k, ()) if comm.rank in ranks
                        and (e.layout.offsets, e.layout.sizes, e.layout.flat) == box]
            for e in held[:1]:
                if staged is not None:
                    staged.wait(e.key, e.local.numel() * e.local.element_size())
                mine[i] = e
                dev = int(_on_device(e.local))
                v = _fingerprint(e.local, weighted=bool(dev))
                words[:, i] = torch.tensor([v, -v, dev, -dev])
    except Exception as ex:  # (staging failed) after the collective, on every rank
        err = ex
    lo, _ = comm.min_max(words.reshape(-1), "save (comparing replicated tensors)")
    comm.agree(err, "save (staging)" if staged is not None else "save (comparing replicated tensors)")
    lo = lo.reshape(4, n)
    vals = words[0]
    mixed = [i for i in range(n) if int(lo[2, i]) != -int(lo[3, i])]  # held on the host and on accelerators
    same = [int(lo[0, i]) == -int(lo[1, i]) for i in range(n)]
    if mixed:  # (the same list on every rank: it comes from the all-reduce)
        again = torch.full((2, len(mixed)), hi, dtype=torch.int64)
        try:
            for j, i in enumerate(mixed):
                if i in mine:
                    v = _fingerprint(mine[i].local, weighted=True)
                    again[:, j] = torch.tensor([v, -v])
        except Exception as ex:
            err = ex
        lo2, _ = comm.min_max(again.reshape(-1), "save (comparing replicated tensors on host and accelerators)")
        comm.agree(err, "save (comparing replicated tensors on host and accelerators)")
        lo2 = lo2.reshape(2, len(mixed))
        for j, i in enumerate(mixed):
            same[i] = int(lo2[0, j]) == -int(lo2[1, j])
            vals[i] = again[0, j]
    differ = [i for i in range(n) if not same[i]]
    if differ:
        i = differ[0]
        (role, name), box, _ = groups[i]
        # which rank holds which value (every rank is here: the all-reduce above decided it)
        fps = [int(x) for x in comm.all_gather_bytes(str(int(vals[i])).encode(), "save (naming the differing copies)")]
        by_value: dict[int, list[int]] = {}
        for r, fp in enumerate(fps):
            if fp != hi:
                by_value.setdefault(fp, []).append(r)
        sides = ", ".join(f"{f'ranks {rs} hold' if len(rs) > 1 else f'rank {rs[0]} holds'} one value" if k == 0 else
                          f"{f'ranks {rs}' if len(rs) > 1 else f'rank {rs[0]}'} another"
                          for k, rs in enumerate(sorted(by_value.values())))
        more = f" ({len(differ) - 1} more differ: {[f'{groups[j][0][0]}/{groups[j][0][1]}' for j in differ[1:4]]})" \
            if len(differ) > 1 else ""
        if box is None:
            raise StateDictError(
                f"tensor {name!r} (role {role}) is held whole as the saved copy by several ranks (a plain tensor, or a "
                f"DTensor replicated over its mesh) with different values: {sides}{more}. It is saved once for all "
                "ranks. Wrap values that differ per rank (RNG states, data positions) in unickpt.per_rank(...), "
                "describe shards with unickpt.shard(...) or a DTensor, or make the ranks agree (broadcast) before saving")
        raise StateDictError(
            f"tensor {name!r} (role {role}): the block at offsets {list(box[0])} (sizes {list(box[1])}"
            f"{f', flat range {list(box[2])}' if box[2] else ''}) is held as the saved copy (replica 0) by several "
            f"ranks with different values: {sides}{more}. One copy is saved for all of them. Make the copies agree "
            "before saving, or describe blocks that are not copies with their own offsets")


def _replica_groups(plan: SavePlan) -> list[tuple[tuple[str, str], tuple | None, list[int] | None]]:
    """What :func:`_check_replicas` compares, in plan order (the same on every rank):
    ``(key, None, None)`` for a tensor several ranks hold whole as replica 0, ``(key, (offsets,
    sizes, flat), ranks)`` for each block the plan made copies of. Computed once per plan (a
    cached plan serves every save of a training run)."""
    if plan._replica_groups is None:
        groups = [(k, None, None) for k, t in plan.tensors.items() if len(t.full_holders) > 1 and t.numel
                  and sum(1 for _, lay in t.full_pieces() if lay.replica == 0) > 1]
        groups += [(k, (offsets, sizes, flat), ranks) for k, t in plan.tensors.items()
                   for offsets, sizes, flat, ranks in t.copies]
        plan._replica_groups = groups
    return plan._replica_groups


def _gather_json(comm: Comm, obj, what: str) -> list:
    return [json.loads(b) for b in comm.all_gather_bytes(json.dumps(obj).encode(), what)]


def _exception_report(plan: SavePlan, rank: int, exceptions: dict) -> dict:
    """Residual exceptions of the tensors this rank is a written source of."""
    out = {}
    for key, (idx, bits) in exceptions.items():
        t = plan.tensors.get(key)
        if t is not None and len(idx) and t.sources_of(rank):  # (its own pieces only: O(1) in the world size)
            out[f"{key[0]}/{key[1]}"] = [idx.tolist(), bits.tolist()]
    return out


def _tiled(ext: list, nbytes: int, what: str) -> tuple:
    ext = sorted(tuple(e) for e in ext)
    pos = 0
    for b, e, _ in ext:
        if b != pos:
            raise UnickptError(f"{what}: checksummed ranges leave bytes {pos}..{b} unwritten")
        pos = e
    if pos != nbytes:
        raise UnickptError(f"{what}: only {pos} of {nbytes} bytes were written")
    return tuple(ext)


def _manifest(plan: SavePlan, reports: list[dict], step, json_state, extra, strategy, dropped=None,
              comp: Compression | None = None, name_of=str, lossy_generations: int = 0,
              step_args: dict | None = None) -> Manifest:
    """``name_of``: the stored name of a planned file (:meth:`unickpt.commit.Transaction.file_name`).
    ``lossy_generations``: those of the state saved, before this save; ``step_args``: what
    this save adds to quantized tensors' tags (:func:`_step_args`)."""
    checksums: dict[str, list] = {}
    qerr: dict[str, list] = {}
    sizes: dict[str, int] = {}
    excs: dict[str, list] = {}
    framed: dict[str, dict] = {}
    for r in reports:
        framed.update(r.get("zstd", {}))
        for k, ext in r.get("checksums", {}).items():
            checksums.setdefault(k, []).extend(ext)
        for name, n in r.get("files", {}).items():
            sizes[name] = sizes.get(name, 0) + n
        for k, st in r.get("qerr", {}).items():
            merge_error(qerr.setdefault(k, []), st)
        for k, (idx, bits) in r.get("exceptions", {}).items():
            e = excs.setdefault(k, [[], []])
            e[0].extend(idx)
            e[1].extend(bits)
    tensors = {}
    for t in plan.tensors.values():
        what = f"tensor {t.name!r} (role {t.role})"
        k = f"{t.role}/{t.name}"
        if t.codec is None:
            ext = _tiled(checksums.get(k, []), t.nbytes, what)
            tensors[t.key] = TensorEntry(t.role, t.name, name_of(t.file), t.dtype, t.shape, t.begin, t.end, ext, "raw",
                                         t.writer)
            continue
        codec = t.codec["codec"]
        args = {a: v for a, v in t.codec.items() if a != "codec"}
        if codec == "residual16":
            idx, bits = excs.get(k, [[], []])
            order = sorted(range(len(idx)), key=idx.__getitem__)
            args["exceptions"] = [[idx[i] for i in order], [bits[i] for i in order]]
            n = t.numel
            if len(idx) > max(16, n * EXCEPTION_WARN):
                log.warning("%s: %d of %d master elements are not reproduced by bf16 model + low 16 bits; the model "
                            "weights are not the bf16 rounding of the master weights (stored as exceptions)", what, len(idx), n)
            parts = {"low16": Part(f"{t.name}::low16", "I16", t.shape, t.begin, t.end, _tiled(checksums.get(k, []), t.nbytes, what))}
            dtype = "F32"
        else:
            parts = {}
            for p, (key, dt, sh, b, e) in t.parts.items():
                parts[p] = Part(key, dt, sh, b, e, _tiled(checksums.get(f"{k}#{p}", []), e - b, f"{what} part {p}"))
            dtype = t.dtype
            args.update((step_args or {}).get(t.key, {}))
            args["generations"] = lossy_generations + 1
            if k in qerr:
                args["error"] = error_record(qerr[k])
        tensors[t.key] = TensorEntry(t.role, t.name, name_of(t.file), dtype, t.shape, t.begin, t.end, (), codec, t.writer,
                                     parts, args)
    for (role, name), (dt, shape, model) in (dropped or {}).items():
        m = tensors[("model", model)]
        tensors[(role, name)] = TensorEntry(role, name, m.file, dt, tuple(shape), 0, 0, (), "from_model", m.writer,
                                            {}, {"model": model})
    files = {}
    for f in plan.files:
        if sizes.get(f.name) != f.size:
            raise UnickptError(f"{f.name}: writers reported {sizes.get(f.name)} bytes, planned {f.size}")
        z = framed.get(f.name)
        if z is not None:
            frames = sorted(z["frames"])
            files[name_of(f.name)] = FileEntry(name_of(f.name), f.role, f.node, f.writer, f.size, len(f.header), "zstd",
                                               z["stored"], frames,
                                      Hasher.of(f.header))
        else:
            files[name_of(f.name)] = FileEntry(name_of(f.name), f.role, f.node, f.writer, f.size, len(f.header),
                                               header_xxh3=Hasher.of(f.header))
    from . import __version__

    quantized = any(t.codec is not None and t.quantized for t in plan.tensors.values())
    generations = lossy_generations + (1 if quantized else 0)
    record = comp.to_json() if comp is not None and comp.active else {}
    if generations:  # (the state's history, also through lossless saves: the next resume carries it on)
        record["lossy_generations"] = generations
    return Manifest(
        compression=record,
        step=step,
        files=files,
        tensors=tensors,
        state=json_state,
        extra=extra,
        saved_by={
            "world_size": plan.world,
            "nodes": sorted(set(plan.nodes)),
            "strategy": strategy,
            "unickpt_version": __version__,
            "torch_version": torch.__version__.split("+")[0],
        },
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def _encode_fragments(fragments: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray()
    for fi, off, data in fragments:
        out += struct.pack("<IQI", fi, off, len(data))
        out += data
    return bytes(out)


def _finish_files(plan: SavePlan, rank: int, storage: Storage, tmp: str, blobs: list[bytes], name_of=str) -> None:
    mine = {i for i, f in enumerate(plan.files) if f.writer == rank}
    frags: dict[int, list[tuple[int, bytes]]] = {i: [] for i in mine}
    for blob in blobs:
        pos = 0
        while pos < len(blob):
            fi, off, n = struct.unpack_from("<IQI", blob, pos)
            pos += 16
            if fi in mine:
                frags[fi].append((off, blob[pos : pos + n]))
            pos += n
    for fi in sorted(mine):
        f = plan.files[fi]
        if f.zstd:  # written by its owner alone, fsynced on close
            if frags[fi]:
                raise UnickptError(f"{f.name}: framed file received in-place fragments")
            continue
        storage.finish_file(storage.join(tmp, name_of(f.name)), frags[fi], f.size)


class StagedBytes(Protocol):
    """Entries whose bytes are still being copied in (the asynchronous writer's staging)."""

    def wait(self, key: tuple[str, str], nbytes: int) -> None:
        """Block until the first ``nbytes`` bytes of entry ``key`` are in place; raise if the
        copy failed before them (or did not get there within the save's timeout)."""

    def wait_all(self) -> None:
        """Block until the whole copy is done; raise if it failed."""


class _Source:
    """Host bytes of a local tensor, on demand (device tensors are copied per range). With
    ``staged``, each range waits for its bytes first."""

    def __init__(self, entry: Entry, staged: StagedBytes | None = None) -> None:
        t = entry.local.detach()
        self.device = t.device
        self.key, self.staged = entry.key, staged
        if staged is not None and not t.is_contiguous():  # the copy below reads every byte
            staged.wait(entry.key, t.numel() * t.element_size())
        self.flat = as_bytes(t if t.is_contiguous() else t.contiguous())  # (a device tensor stays on device)

    def host_range(self, start: int, stop: int) -> torch.Tensor:
        if self.staged is not None:
            self.staged.wait(self.key, stop)
        v = self.flat[start:stop]
        return v if self.device.type == "cpu" else v.to("cpu")


_BUCKETS: list[torch.Tensor] = []  # kept across saves: fresh memory costs 4-8x a copy


def _bucket(slot: int, need: int) -> torch.Tensor:
    while len(_BUCKETS) <= slot:
        _BUCKETS.append(torch.empty(0, dtype=torch.uint8))
    if _BUCKETS[slot].numel() < need:
        _BUCKETS[slot] = torch.empty(need, dtype=torch.uint8)
    return _BUCKETS[slot]


def _step_args(plan: SavePlan, comp: Compression, opts: SaveOptions) -> dict[tuple[str, str], dict]:
    """Per quantized tensor, what this save adds to its (step-independent, cached) tag: the
    rounding seed of its step (compress.save_args)."""
    return {t.key: a for t in plan.tensors.values() if t.quantized
            for a in [save_args(t.codec, t.role, t.name, comp, opts.step)] if a}


def _write_rank(plan: SavePlan, comm: Comm, by_key, storage: Storage, tmp: str, direct_io, ph: Phases, progress,
                name_of=str, staged: StagedBytes | None = None, step_args: dict | None = None):
    """Write this rank's share: headers of its files, its runs of direct tensors (in place,
    into whichever file holds them), and the gathered tensors it owns (via buckets).

    File errors (disk full, EIO...) never leave the communication schedule: the rank keeps
    sending and receiving until the last step, so peers are not stranded in a transfer, and
    the error is raised afterwards (then agreed on by every rank).
    """
    rank = comm.rank
    files = plan.files
    file_index = {f.name: i for i, f in enumerate(files)}
    extents = []  # (file index, tensor, local elem, tensor elem, count)
    for t in plan.tensors.values():
        if t.direct:
            for _, lo, g, n in extents_of(t, rank):
                extents.append((file_index[t.file], t, lo, g, n))
    extents.sort(key=lambda e: (e[0], e[1].begin + e[3] * e[1].itemsize))
    needed = sorted({i for i, f in enumerate(files) if f.writer == rank} | {e[0] for e in extents})
    writers = {}
    gathered = {t.key: BlockHasher() for f in files if f.writer == rank for t in f.tensors if not t.direct and not t.quantized}
    checks: dict[str, list] = {}
    qerr: dict[str, list] = {}  # quantized tensors: their encoding's error (compress.add_error), merged in the manifest
    sources: dict[tuple[str, str], _Source] = {}
    io_error: list[BaseException] = []
    total = sum(len(files[i].header) for i in needed if files[i].writer == rank)
    total += sum(n * t.itemsize for _, t, _, _, n in extents)
    total += sum(t.nbytes for f in files if f.writer == rank for t in f.tensors if not t.direct)
    done = [0]

    # built up front, in this thread: the writer thread and the gather loop both read them
    # (a lazy cache filled from two threads could copy a non-contiguous tensor twice)
    try:
        for k in {t.key for _, t, _, _, _ in extents} | {
            t.key for st in plan.schedule(rank) for t in [*(x[1] for x in st.sends), *(x[0] for x in st.copies)]
        }:
            sources[k] = _Source(by_key[k], staged)
    except Exception as e:  # e.g. no memory for a contiguous copy: drain the steps, then raise
        io_error.append(e)

    def src(key) -> _Source:
        return sources[key]

    progress_off = [False]

    def note(n: int) -> None:
        done[0] += n
        if progress is not None and not progress_off[0]:
            try:
                progress(done[0], total)
            except Exception as e:  # a callback must not take the save (and its peers) down
                log.warning("progress callback failed: %s", e)
                progress_off[0] = True

    io = ThreadPoolExecutor(1, thread_name_prefix="unickpt-write")
    pending: list[Future | None] = [None, None]

    def reap(slot: int) -> None:
        fut = pending[slot]
        pending[slot] = None
        if fut is not None and fut.exception() is not None and not io_error:
            io_error.append(fut.exception())

    def write_direct() -> None:
        for i in needed:
            if files[i].writer == rank:
                writers[i].write_at(0, memoryview(files[i].header))
        for fi, t, lo, g, n in extents:
            isz = t.itemsize
            view = src(t.key).host_range(lo * isz, (lo + n) * isz)
            mv = memoryview(view.numpy())
            start = g * isz
            # sources do not change during a save (``view`` stays referenced by the write):
            # the writer may take the bytes straight from memory, while this thread hashes them
            writers[fi].write_at(len(files[fi].header) + t.begin + start, mv, stable=True)
            checks.setdefault(f"{t.role}/{t.name}", []).extend(block_sums(mv, start))

    try:
        try:
            for i in needed:
                path_i = storage.join(tmp, name_of(files[i].name))
                if files[i].zstd:
                    writers[i] = ZstdWriter(storage.open_writer(path_i, direct=False), files[i].zstd)
                else:
                    writers[i] = storage.open_writer(path_i, direct=direct_io, size=files[i].size)
        except Exception as e:  # any error (not only OSError): the schedule must still be served
            io_error.append(e)
        if not io_error:
            pending[1] = io.submit(write_direct)
        for s, step in enumerate(plan.schedule(rank)):
            slot = s % 2
            reap(slot)
            if io_error:  # keep serving peers with the right message sizes; write nothing more
                _drain_step(step, comm)
                continue
            need = sum(seg.nbytes for seg, whole in zip(step.segments, step.local_whole) if whole is None)
            try:
                with ph.phase("gather"):
                    items = _run_step(step, comm, src, _bucket(slot, need) if need else None)
            except _Unsent as e:  # failed before this step's transfers were posted
                io_error.append(e.__cause__ or e)
                _drain_step(step, comm)
                continue
            except Exception as e:  # after the transfers: later steps are drained above
                io_error.append(e)
                continue
            pending[slot] = io.submit(_write_items, items, writers, gathered, files, checks, qerr, step_args or {})
            note(sum(int(v.numel()) for _, _, v, _, _ in items))
        reap(0)
        reap(1)
        if io_error:
            raise io_error[0]
        # the direct runs and file headers (written by write_direct): progress ends at total
        note(sum(n * t.itemsize for _, t, _, _, n in extents)
             + sum(len(files[i].header) for i in needed if files[i].writer == rank))
        written = {}
        framed = {}
        for i, w in writers.items():
            written[files[i].name] = w.bytes_written
            if isinstance(w, ZstdWriter):
                framed[files[i].name] = w
        fragments = []
        with ph.phase("fsync"):
            for i, w in list(writers.items()):
                for off, data in w.close():
                    fragments.append((i, off, data))
                del writers[i]
    except BaseException:
        for slot in (0, 1):
            if pending[slot] is not None:
                pending[slot].exception()
        for w in writers.values():
            w.abort()
        raise
    finally:
        io.shutdown(wait=True)
    for k, h in gathered.items():
        checks[f"{k[0]}/{k[1]}"] = h.finish()
    zst = {n: {"stored": w.pos, "frames": w.frames} for n, w in framed.items()}
    stored = sum(written.values()) + sum(w.pos - w.logical for w in framed.values())
    return {"checksums": checks, "files": written, "bytes": stored, "zstd": zst, "qerr": qerr}, fragments


class _Unsent(Exception):
    """Preparing a step failed before any of its transfers was posted."""


def _drain_step(step: Step, comm: Comm) -> None:
    """Take part in a step's transfers without data (after a local error), so that peers
    are not left waiting; what they receive from us is discarded with the failed save."""
    sends = [(dst, torch.zeros(runs.numel * t.itemsize, dtype=torch.uint8)) for dst, t, runs in step.sends]
    recvs = [(r, torch.empty(runs.numel * t.itemsize, dtype=torch.uint8)) for r, t, _, runs in step.recvs]
    comm.exchange(sends, recvs)


def _run_step(step: Step, comm: Comm, src, bucket: torch.Tensor | None):
    """Assemble this rank's segments of one step; return ``(file_index, key, bytes)`` items.
    Raises :class:`_Unsent` if it fails before posting the step's transfers."""
    try:
        sends, recvs, scatters, offs = _prepare_step(step, src, bucket)
    except Exception as e:
        raise _Unsent(str(e)) from e
    comm.exchange(sends, recvs)
    return _finish_step(step, src, bucket, scatters, offs)


def _prepare_step(step: Step, src, bucket):
    offs: list[int] = []
    pos = 0
    for seg, whole in zip(step.segments, step.local_whole):
        offs.append(pos)
        if whole is None:
            pos += seg.nbytes
    sends, recvs, scatters = [], [], []
    for dst, t, runs in step.sends:
        s = src(t.key)
        isz = t.itemsize
        if len(runs) == 1:
            a = int(runs.starts[0]) * isz
            sends.append((dst, s.host_range(a, a + int(runs.lengths[0]) * isz)))
        else:
            packed = torch.empty(runs.numel * isz, dtype=torch.uint8)
            lo = int(runs.starts[0]) * isz
            hi = int(runs.starts[-1] + runs.lengths[-1]) * isz
            window = s.host_range(lo, hi)
            copy_runs(window, runs.starts - lo // isz, packed, runs.local, runs.lengths, isz)
            sends.append((dst, packed))
    for r, t, si, runs in step.recvs:
        isz = t.itemsize
        base = offs[si]
        if len(runs) == 1:
            a = base + int(runs.starts[0]) * isz
            recvs.append((r, bucket[a : a + int(runs.lengths[0]) * isz]))
        else:
            tmp = torch.empty(runs.numel * isz, dtype=torch.uint8)
            recvs.append((r, tmp))
            scatters.append((tmp, base, runs, isz))
    for t, si, lruns, sruns in step.copies:
        if step.local_whole[si] is not None:
            continue
        s = src(t.key)
        isz = t.itemsize
        lo = int(lruns.starts[0]) * isz
        hi = int(lruns.starts[-1] + lruns.lengths[-1]) * isz
        window = s.host_range(lo, hi)
        base = offs[si]
        copy_runs(window, lruns.starts - lo // isz, bucket[base:], sruns.starts, lruns.lengths, isz)
    return sends, recvs, scatters, offs


def _finish_step(step: Step, src, bucket, scatters, offs):
    for tmp, base, runs, isz in scatters:
        copy_runs(tmp, runs.local, bucket[base:], runs.starts, runs.lengths, isz)
    items = []
    for si, (seg, whole) in enumerate(zip(step.segments, step.local_whole)):
        t = seg.tensor
        isz = t.itemsize
        if seg.nbytes == 0:
            view = torch.empty(0, dtype=torch.uint8)
        elif whole is not None:
            view = src(t.key).host_range(whole * isz, whole * isz + seg.nbytes)
        else:
            view = bucket[offs[si] : offs[si] + seg.nbytes]
        items.append((seg.file_index, t, view, t.begin + seg.start * isz, seg.start))
    return items


def _write_items(items, writers, hashers, files, checks, qerr, step_args) -> None:
    """Write one step's segments (runs on the writer thread); quantized segments (whole
    groups) are encoded here, so encoding overlaps the next step's gather."""
    for fi, t, view, offset, start in items:
        if view.numel() == 0:
            continue
        hdr = len(files[fi].header)
        if t.quantized:
            if view.data_ptr() % 8:
                view = view.clone()
            x = view.view(torch_dtype(t.dtype))
            tag = {**t.codec, **step_args[t.key]} if t.key in step_args else t.codec
            for part, poff, data in encode_chunk(tag, x, start, f"tensor {t.name!r} (role {t.role})",
                                                 qerr.setdefault(f"{t.role}/{t.name}", [])):
                if data.numel() == 0:
                    continue
                mv = memoryview(data.numpy())
                checks.setdefault(f"{t.role}/{t.name}#{part}", []).extend(block_sums(mv, poff))
                writers[fi].write_at(hdr + t.parts[part][3] + poff, mv)
            continue
        mv = memoryview(view.numpy())
        hashers[t.key].update(mv)
        writers[fi].write_at(hdr + offset, mv)
