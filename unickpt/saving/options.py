"""What a save is asked to do (:class:`SaveOptions`, checked once when built) and what it did
(:class:`SaveResult`)."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from .._metrics import gbps
from ..compress import Compression
from ..errors import InvalidArgumentError, StateDictError
from ..manifest import INDEX_NAME, MANIFEST_NAME
from ..state import _is_json, to_json
from ..transport import resolve_timeout


__all__ = ["DEFAULT_BUCKET", "MAX_GENERATIONS", "ProgressFn", "SaveOptions", "SaveResult"]

DEFAULT_BUCKET = 256 << 20


_EXTRA_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


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

