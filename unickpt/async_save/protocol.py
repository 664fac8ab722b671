"""What a trainer and its writer process say to each other over their pipe.

The pipe is ``multiprocessing``'s duplex connection (framed byte strings) between a trainer
and the writer process it started (:mod:`.lifecycle`); tensors never travel on it, only
through the staging segment (:mod:`.segment`). Every message is one JSON object. Nothing is
pickled: a message is parsed by :func:`json.loads` and checked here, field by field, into
one of the dataclasses below before either side acts on it; a message that is not one of
them (not JSON, an unknown ``op``, a missing, unknown or mistyped field, an entry whose
bytes lie outside its segment) is a :class:`ProtocolError`.

Trainer to writer (:func:`decode_command`):

* :class:`SaveCommand` ``{"op": "save", ...}``: save the state staged in a segment;
* :class:`StagedUpTo` ``{"op": "staged", "end", "done"}``: the trainer's copy into the
  segment has reached byte ``end`` (a save's command may come before its copy: background
  staging);
* :class:`AbortSave` ``{"op": "abort", "error"}``: the copy failed: fail the save on every writer;
* :class:`ExitWriter` ``{"op": "exit"}``.

Writer to trainer (:func:`decode_reply`):

* :class:`Ready` ``{"op": "ready"}``: the writer joined the writers' group (its first message);
* :class:`ProgressReport` ``{"op": "progress", "done", "total"}``;
* :class:`SaveSucceeded` ``{"ok": true, "result", "results", "phases"}``;
* :class:`SaveFailed` ``{"ok": false, "error", "type", "results"}`` (the last two optional):
  a save, or the writer's set-up, failed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from ..errors import AsyncSaveError, FormatError, LayoutError
from ..format import itemsize
from ..layout import Layout
from ..saving import SaveOptions, SaveResult

__all__ = ["ProtocolError", "StagedEntry", "SaveCommand", "StagedUpTo", "AbortSave", "ExitWriter", "Ready",
           "ProgressReport", "SaveSucceeded", "SaveFailed", "encode", "decode_command", "decode_reply",
           "READY_BYTES", "writer_path"]


class ProtocolError(AsyncSaveError):
    """A message on a trainer-writer pipe that is not one of this protocol's."""


def writer_path(path) -> str:
    """``path`` as the writer process gets it: a URL (``scheme://...``) as given, a local
    path made absolute (the writer shares our working directory, but a path that means the
    same whatever the directory is safer)."""
    p = os.fspath(path)
    return p if "://" in p else os.path.abspath(p)


# -- checks of decoded JSON values ----------------------------------------------------------------


def _int(v: Any, what: str, low: int = 0) -> int:
    if type(v) is not int or v < low:  # (not a bool, not a float)
        raise ProtocolError(f"{what} must be an integer >= {low}, got {_show(v)}")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str:
        raise ProtocolError(f"{what} must be a string, got {_show(v)}")
    return v


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{what} must be true or false, got {_show(v)}")
    return v


def _list(v: Any, what: str) -> list:
    if type(v) is not list:
        raise ProtocolError(f"{what} must be a list, got {_show(v)}")
    return v


def _ints(v: Any) -> bool:
    return type(v) is list and all(type(x) is int for x in v)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 200 else s[:200] + "..."


def _fields(msg: dict, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    missing = [k for k in required if k not in msg]
    unknown = sorted(str(k) for k in msg if k not in required and k not in optional)
    if missing or unknown:
        said = [f"missing {', '.join(missing)}"] if missing else []
        said += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise ProtocolError(f"{what}: {'; '.join(said)}")


def _layout(shape: Any, lay: Any, what: str) -> Layout:
    if not (_ints(shape) and type(lay) is list and len(lay) == 4 and _ints(lay[0]) and _ints(lay[1])
            and (lay[2] is None or (_ints(lay[2]) and len(lay[2]) == 2)) and type(lay[3]) is int):
        raise ProtocolError(f"{what}: not a layout: shape {_show(shape)}, layout {_show(lay)}")
    try:
        return Layout.from_json(shape, lay)
    except LayoutError as e:
        raise ProtocolError(f"{what}: {e}") from None


# -- trainer to writer ------------------------------------------------------------------------------


@dataclass(slots=True)
class StagedEntry:
    """One tensor of the state as it sits in the staging segment: its bytes are
    ``segment[offset : offset + nbytes]``, of safetensors dtype ``dtype``; the rest is the
    state entry's (:class:`~unickpt.state.Entry`). On the wire, a list:
    ``[role, name, dtype, shape, layout, offset, nbytes, aliases, per_rank]``. (Not frozen:
    the trainer places its entries in the segment after it has made them, see
    :func:`~.staging.place`.)"""

    role: str
    name: str
    dtype: str
    layout: Layout
    offset: int
    nbytes: int
    aliases: tuple[str, ...] = ()
    per_rank: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    def to_wire(self) -> list:
        lay = self.layout
        return [self.role, self.name, self.dtype, list(lay.shape), lay.to_json(), self.offset, self.nbytes,
                list(self.aliases), self.per_rank]

    @classmethod
    def from_wire(cls, row: Any, segment_size: int, what: str) -> "StagedEntry":
        if type(row) is not list or len(row) != 9:
            raise ProtocolError(f"{what} must be a list of 9 fields, got {_show(row)}")
        role, name, dtype, shape, lay, offset, nbytes, aliases, per_rank = row
        what = f"{what} ({_str(role, f'{what}: role')}/{_str(name, f'{what}: name')})"
        try:
            size = itemsize(_str(dtype, f"{what}: dtype"))
        except FormatError as e:
            raise ProtocolError(f"{what}: {e}") from None
        layout = _layout(shape, lay, what)
        offset, nbytes = _int(offset, f"{what}: offset"), _int(nbytes, f"{what}: nbytes")
        if offset + nbytes > segment_size:
            raise ProtocolError(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside the segment of "
                                f"{segment_size} bytes")
        if offset % size or nbytes % size:
            raise ProtocolError(f"{what}: offset {offset} or size {nbytes} is not a whole number of {dtype} elements")
        aliases = tuple(_str(a, f"{what}: alias") for a in _list(aliases, f"{what}: aliases"))
        return cls(role, name, dtype, layout, offset, nbytes, aliases, _bool(per_rank, f"{what}: per_rank"))


@dataclass(frozen=True)
class SaveCommand:
    """Save the state staged in segment ``segment`` (of ``segment_size`` bytes) at ``path``,
    then at each path of ``also`` (``replicas=0``), with ``opts``; ``state`` is the state's
    JSON part (:func:`~unickpt.state.flatten`'s); ``timeout_s`` bounds the writers' waits for
    each other (``None``: the writer's own); ``progress``: send :class:`ProgressReport`\\ s."""

    OP: ClassVar[str] = "save"
    segment: str
    segment_size: int
    entries: list[StagedEntry]
    state: Any
    path: str
    also: list[str]
    timeout_s: float | None
    opts: SaveOptions
    progress: bool

    def to_wire(self) -> dict:
        return {"op": self.OP, "shm": self.segment, "shm_size": self.segment_size,
                "entries": [e.to_wire() for e in self.entries], "state": self.state, "path": self.path,
                "also": list(self.also), "timeout_s": self.timeout_s, "opts": self.opts.to_json(),
                "progress": self.progress}

    @classmethod
    def from_wire(cls, msg: dict) -> "SaveCommand":
        _fields(msg, "save command", ("op", "shm", "shm_size", "entries", "state", "path", "opts"),
                ("also", "timeout_s", "progress"))
        segment = _str(msg["shm"], "the segment's name")
        if segment in ("", ".", "..") or os.path.basename(segment) != segment or "\0" in segment:
            raise ProtocolError(f"the segment's name must be a plain file name, got {_show(segment)}")
        size = _int(msg["shm_size"], "the segment's size", 1)
        rows = _list(msg["entries"], "entries")
        entries = [StagedEntry.from_wire(row, size, f"entry {i}") for i, row in enumerate(rows)]
        also = [_str(p, "an also= path") for p in _list(msg.get("also") or [], "also")]
        timeout = msg.get("timeout_s")
        if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):
            raise ProtocolError(f"timeout_s must be a number of seconds >= 0, got {_show(timeout)}")
        if type(msg["opts"]) is not dict:
            raise ProtocolError(f"opts must be an object, got {_show(msg['opts'])}")
        return cls(segment, size, entries, msg["state"], _str(msg["path"], "path"), also, timeout,
                   SaveOptions.from_json(msg["opts"]), _bool(msg.get("progress", False), "progress"))


@dataclass(frozen=True)
class StagedUpTo:
    """The segment holds the state up to byte ``end``; ``done``: the copy is over."""

    OP: ClassVar[str] = "staged"
    end: int
    done: bool = False

    def to_wire(self) -> dict:
        return {"op": self.OP, "end": int(self.end), "done": bool(self.done)}

    @classmethod
    def from_wire(cls, msg: dict) -> "StagedUpTo":
        _fields(msg, "staged", ("op", "end"), ("done",))
        return cls(_int(msg["end"], "end"), _bool(msg.get("done", False), "done"))


@dataclass(frozen=True)
class AbortSave:
    """The trainer's copy failed with ``error``: the save fails on every writer."""

    OP: ClassVar[str] = "abort"
    error: str

    def to_wire(self) -> dict:
        return {"op": self.OP, "error": self.error}

    @classmethod
    def from_wire(cls, msg: dict) -> "AbortSave":
        _fields(msg, "abort", ("op", "error"))
        return cls(_str(msg["error"], "error"))


@dataclass(frozen=True)
class ExitWriter:
    """Stop the writer (it leaves its group and exits)."""

    OP: ClassVar[str] = "exit"

    def to_wire(self) -> dict:
        return {"op": self.OP}

    @classmethod
    def from_wire(cls, msg: dict) -> "ExitWriter":
        _fields(msg, "exit", ("op",))
        return cls()


Command = Union[SaveCommand, StagedUpTo, AbortSave, ExitWriter]
_COMMANDS: dict[str, type] = {c.OP: c for c in (SaveCommand, StagedUpTo, AbortSave, ExitWriter)}


# -- writer to trainer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The writer has joined the writers' group."""

    OP: ClassVar[str] = "ready"

    def to_wire(self) -> dict:
        return {"op": self.OP}

    @classmethod
    def from_wire(cls, msg: dict) -> "Ready":
        _fields(msg, "ready", ("op",))
        return cls()


@dataclass(frozen=True)
class ProgressReport:
    """``done`` of ``total`` bytes of the save are written (the save's progress callback)."""

    OP: ClassVar[str] = "progress"
    done: int
    total: int

    def to_wire(self) -> dict:
        return {"op": self.OP, "done": self.done, "total": self.total}

    @classmethod
    def from_wire(cls, msg: dict) -> "ProgressReport":
        _fields(msg, "progress", ("op", "done", "total"))
        return cls(_int(msg["done"], "done"), _int(msg["total"], "total"))


_RESULT_FIELDS = ("path", "step", "files", "bytes", "local_bytes", "seconds", "phases")


def _result_to_wire(r: SaveResult) -> dict:
    return {"path": r.path, "step": r.step, "files": r.files, "bytes": r.bytes, "local_bytes": r.local_bytes,
            "seconds": r.seconds, "phases": r.phases}


def _result_from_wire(d: Any) -> SaveResult:
    if type(d) is not dict:
        raise ProtocolError(f"a save's result must be an object, got {_show(d)}")
    _fields(d, "a save's result", _RESULT_FIELDS[:-1], _RESULT_FIELDS[-1:])
    step, seconds, phases = d["step"], d["seconds"], d.get("phases", {})
    if (step is not None and type(step) is not int) or type(seconds) not in (int, float) or type(phases) is not dict \
            or not all(type(k) is str and type(v) in (int, float) for k, v in phases.items()):
        raise ProtocolError(f"a save's result has a mistyped step, seconds or phases: {_show(d)}")
    files = [_str(f, "a result's file") for f in _list(d["files"], "a result's files")]
    return SaveResult(path=_str(d["path"], "a result's path"), step=step, files=files,
                      bytes=_int(d["bytes"], "a result's bytes"),
                      local_bytes=_int(d["local_bytes"], "a result's local_bytes"), seconds=seconds,
                      phases=dict(phases))


@dataclass(frozen=True)
class SaveSucceeded:
    """The save committed ``result`` (its first path) and every path of ``results`` (the
    first, then the ``also`` copies). ``phases``: the page phase the writer's plan gives each
    staged entry (``None``: none), for the next staging of the same entries."""

    result: SaveResult
    results: list[SaveResult]
    phases: list[int | None] | None = None

    def to_wire(self) -> dict:
        return {"ok": True, "result": _result_to_wire(self.result),
                "results": [_result_to_wire(r) for r in self.results], "phases": self.phases}

    @classmethod
    def from_wire(cls, msg: dict) -> "SaveSucceeded":
        _fields(msg, "a save's success", ("ok", "result"), ("results", "phases"))
        result = _result_from_wire(msg["result"])
        results = [_result_from_wire(r) for r in _list(msg["results"], "results")] if msg.get("results") else [result]
        phases = msg.get("phases")
        if phases is not None and not (type(phases) is list and all(p is None or type(p) is int for p in phases)):
            raise ProtocolError(f"phases must be a list of integers or nulls, got {_show(phases)}")
        return cls(result, results, phases)


@dataclass(frozen=True)
class SaveFailed:
    """A save (or the writer's set-up) failed with ``error``; ``type``: the error's class
    name, when it was an exception of the save; ``results``: the paths committed before an
    ``also`` copy failed."""

    error: str
    type: str | None = None
    results: tuple[SaveResult, ...] = ()

    def to_wire(self) -> dict:
        out: dict = {"ok": False, "error": self.error}
        if self.type is not None:
            out["type"] = self.type
        if self.results:
            out["results"] = [_result_to_wire(r) for r in self.results]
        return out

    @classmethod
    def from_wire(cls, msg: dict) -> "SaveFailed":
        _fields(msg, "a save's failure", ("ok", "error"), ("type", "results"))
        kind = msg.get("type")
        if kind is not None:
            _str(kind, "type")
        done = msg.get("results")
        return cls(_str(msg["error"], "error"), kind,
                   tuple(_result_from_wire(r) for r in _list(done, "results")) if done is not None else ())


Reply = Union[Ready, ProgressReport, SaveSucceeded, SaveFailed]
_REPLIES: dict[str, type] = {c.OP: c for c in (Ready, ProgressReport)}


# -- bytes on the pipe --------------------------------------------------------------------------------


def encode(msg: Command | Reply) -> bytes:
    return json.dumps(msg.to_wire()).encode()


def _parse(raw: bytes) -> dict:
    try:
        msg = json.loads(raw)
    except ValueError as e:
        raise ProtocolError(f"not JSON ({e})") from None
    if type(msg) is not dict:
        raise ProtocolError(f"not a JSON object: {_show(msg)}")
    return msg


def decode_command(raw: bytes) -> Command:
    """The trainer's message ``raw``, checked (:class:`ProtocolError` if it is none of them)."""
    msg = _parse(raw)
    cls = _COMMANDS.get(msg.get("op")) if type(msg.get("op")) is str else None
    if cls is None:
        raise ProtocolError(f"unknown command {_show(msg.get('op'))}")
    return cls.from_wire(msg)


def receive(conn) -> "Reply | ProtocolError | None":
    """The next message on the pipe ``conn`` if one has arrived (else None, as when the pipe
    is closed or broken); a malformed one is returned as its :class:`ProtocolError`."""
    try:
        return decode_reply(conn.recv_bytes()) if conn.poll() else None
    except (EOFError, OSError):
        return None
    except ProtocolError as e:
        return e


def decode_reply(raw: bytes) -> Reply:
    """The writer's message ``raw``, checked (:class:`ProtocolError` if it is none of them)."""
    msg = _parse(raw)
    if "op" in msg:
        cls = _REPLIES.get(msg["op"]) if type(msg["op"]) is str else None
        if cls is None:
            raise ProtocolError(f"unknown reply {_show(msg['op'])}")
        return cls.from_wire(msg)
    ok = _bool(msg.get("ok"), "a reply's ok")
    return SaveSucceeded.from_wire(msg) if ok else SaveFailed.from_wire(msg)


READY_BYTES = encode(Ready())
"""A writer's first message once it has joined the writers' group, as it is sent."""
