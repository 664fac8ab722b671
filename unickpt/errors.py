"""Typed errors. Every error unickpt raises on bad input derives from :class:`UnickptError`.

Messages name the checkpoint file and tensor involved and say what was expected, so a
user can act on them without reading the source.
"""

from __future__ import annotations

__all__ = [
    "UnickptError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "NewerVersionError",
    "FormatError",
    "ChecksumError",
    "TensorMissingError",
    "UnexpectedTensorError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "LayoutError",
    "StateDictError",
    "DistributedError",
    "AsyncSaveError",
    "StorageError",
    "CheckpointChangedError",
    "InvalidArgumentError",
    "MappingError",
    "MemoryBudgetError",
    "NotSupportedError",
]


class UnickptError(Exception):
    """Base class of every error raised by unickpt."""


class CheckpointNotFoundError(UnickptError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""


class CheckpointExistsError(UnickptError, FileExistsError):
    """The destination already holds a committed checkpoint and overwrite was not asked."""


class NewerVersionError(CheckpointExistsError):
    """A publish directory already holds a newer version than the one being published
    (subscribers only take newer versions): resume the run, or publish to a fresh directory."""


class FormatError(UnickptError, ValueError):
    """A manifest, index or safetensors header is malformed, hostile or of an unknown version."""


class ChecksumError(UnickptError):
    """Stored bytes do not match the checksum recorded at save time."""

    def __init__(self, message: str, bad: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        #: ``(file, tensor)`` pairs that failed verification.
        self.bad = bad or []


class TensorMissingError(UnickptError, KeyError):
    """The target state dict asks for a tensor the checkpoint does not hold."""

    def __init__(self, message: str, missing: list[str] | None = None, unexpected: list[str] | None = None) -> None:
        super().__init__(message)
        #: ``role/name`` of target tensors the checkpoint does not hold.
        self.missing = list(missing or [])
        #: ``role/name`` of checkpoint tensors, under roles the target names, it does not ask for.
        self.unexpected = list(unexpected or [])

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnexpectedTensorError(TensorMissingError):
    """A strict load: the checkpoint holds tensors, under roles the target names, that the
    target does not ask for (``unexpected``), e.g. the moments of an optimizer whose state
    does not exist yet. A :class:`TensorMissingError` too, so one ``except`` catches both
    directions of a key mismatch."""


class ShapeMismatchError(UnickptError, ValueError):
    """A target tensor's global shape differs from the stored one."""


class DtypeMismatchError(UnickptError, TypeError):
    """A target tensor's dtype differs from the stored one."""


class LayoutError(UnickptError, ValueError):
    """Shards do not describe a valid layout: out of bounds, overlapping, gaps, disagreeing ranks."""


class StateDictError(UnickptError, TypeError):
    """A state dict holds something unickpt cannot save (unsupported leaf, name collision...)."""


class DistributedError(UnickptError, RuntimeError):
    """Another rank failed; the message carries that rank's error."""


class AsyncSaveError(UnickptError, RuntimeError):
    """An asynchronous save failed (on this rank or another one) or its writer process died."""


class StorageError(UnickptError, OSError):
    """The storage failed (disk full, I/O error, permission...): ``errno`` and ``filename``
    are those of the underlying :class:`OSError`."""


class LockTimeoutError(StorageError):
    """A lock on a checkpoint root (the commit lock) stayed held by another process, of this
    user or another, past the caller's ``timeout_s``: ``filename`` is the locked directory."""


class CheckpointChangedError(UnickptError):
    """The checkpoint was replaced (or removed) while it was being read; load it again."""


class MemoryBudgetError(UnickptError, MemoryError):
    """The in-memory tier would not fit in a node's memory (its snapshots, replicas and
    staging, against the memory directory's free space, the host's available memory, or the
    budget given); raised before training starts, naming the node and the figures."""


class MappingError(UnickptError, ValueError):
    """A :class:`~unickpt.Mapping` cannot be honoured for this checkpoint and target (heads a
    TP degree does not divide, sources of other sizes, pieces that do not tile the target)."""


class InvalidArgumentError(UnickptError, ValueError):
    """An argument of a unickpt function is out of its range (the message says which)."""


class NotSupportedError(UnickptError, NotImplementedError):
    """Something unickpt does not do (yet): the message says what and, where there is one,
    the way around it (docs/design.md lists what is not supported)."""


_ASYNC: dict[type, type] = {}


def async_error(kind: str | None, message: str) -> AsyncSaveError:
    """An asynchronous save's error as the trainer raises it, from what its writer reported
    (``kind``: the writer's error class name): an :class:`AsyncSaveError` that is also an
    instance of that class when it is one of these (``except CheckpointExistsError`` catches
    an async save's as it catches a sync save's). Pickles by ``(kind, message)``."""
    cls = globals().get(kind) if isinstance(kind, str) else None
    if not (isinstance(cls, type) and issubclass(cls, UnickptError)) or issubclass(cls, AsyncSaveError):
        return AsyncSaveError(message)
    both = _ASYNC.get(cls)
    if both is None:
        name = f"Async{cls.__name__}"
        both = _ASYNC[cls] = type(name, (AsyncSaveError, cls), {
            "__module__": __name__, "__qualname__": name,
            "__reduce__": lambda self, kind=kind: (async_error, (kind, str(self))),
            "__str__": lambda self: str(self.args[0]) if self.args else ""})
    try:
        return both(message)
    except TypeError:  # (a class whose constructor wants more than a message)
        return AsyncSaveError(message)


def as_typed(exc: BaseException) -> BaseException:
    """``exc`` itself if typed (or not an error of the storage); an :class:`OSError` becomes a
    :class:`StorageError` with the same errno, message and file name."""
    if isinstance(exc, OSError) and not isinstance(exc, UnickptError):
        new = StorageError(exc.errno, exc.strerror or str(exc), exc.filename) if exc.errno else StorageError(str(exc))
        new.__cause__ = exc
        return new
    return exc
