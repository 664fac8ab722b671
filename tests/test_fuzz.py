"""Property-based fuzzing of every parser that reads untrusted checkpoint bytes.

Property: whatever the input, only typed errors escape (subclasses of
:class:`unickpt.errors.UnickptError`), and every input is handled with bounded work and memory,
both counted, never timed (a loaded machine must not fail a test): the calls the library makes
(to its own functions and from them to builtins, json, torch: ``cProfile``'s counts) below
``CALLS_PER_BYTE`` x input + ``CALL_SLACK``, the ``tracemalloc`` peak of the pure-Python parsers below ``MEM_FACTOR`` x
input + ``MEM_SLACK``, and the bytes the codecs' torch operations allocate below
``TORCH_FACTOR`` x (bytes in + out) + ``TORCH_SLACK``. How long the worst cases take is
measured by ``bench/parse_dos.py``.

Parsers: safetensors headers (:func:`unickpt.format.parse_header`, ``read_header``), the
manifest (:meth:`unickpt.manifest.Manifest.from_json`, raw bytes and structure-aware
mutations of real manifests), zstd-framed files (:mod:`unickpt.container`), codec metadata
(:mod:`unickpt.compress`), and end to end: damaged checkpoint directories through
``unickpt.load`` and the CLI.

Reproducible: ``derandomize=True``, no example database. The default run is small (well under
a minute on 2 cores); ``UNICKPT_FUZZ_EXAMPLES=N`` runs N examples per property instead.
Inputs that once found a bug live in ``tests/attacks/<parser>/`` and are replayed by
``test_attack_replay``; ``UNICKPT_FUZZ_STATS=FILE`` writes the worst memory ratio, call count
and (for information only) time seen per parser to FILE (JSON).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import cProfile
import io
import json
import math
import os
import random
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import xxhash
import zstandard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, event, note, settings  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.control import currently_in_test_context  # noqa: E402

import unickpt  # noqa: E402
import unickpt.cli  # noqa: E402
from unickpt import codecs as _cp  # noqa: E402 (the codec registry)

QUANT_CODECS = tuple(n for n in _cp.names(tags=True) if _cp.get(n).quantized)
from unickpt import container as _ct
from unickpt import format as _fmt  # noqa: E402
from unickpt import manifest as _mf  # noqa: E402
from unickpt.errors import ChecksumError, FormatError, UnickptError  # noqa: E402

from tests.crafted import worst_case_inputs  # noqa: E402

FUZZ = int(os.environ.get("UNICKPT_FUZZ_EXAMPLES", "0") or 0)
ATTACKS = Path(__file__).parent / "attacks"
MEM_FACTOR = 50
MEM_SLACK = 4 << 20
# Work, counted: the calls one parser call makes (unickpt_calls). Most inputs cost a few
# hundred whatever their size (json.loads is one call); a JSON float costs one (parse_float):
# 0.5 per byte in the worst case. A per-element Python loop over hostile input goes far above.
CALLS_PER_BYTE = 2
CALL_SLACK = 20_000
# bytes allocated by torch operations during one codec call (outputs of aten ops, views and
# in-place results excluded): decoding needs a few times the bytes it reads and writes, plus
# a few chunk buffers (codecs.CHUNK fp32 elements, 1 MiB, even for an empty range).
TORCH_FACTOR = 16
TORCH_SLACK = 4 * 4 * unickpt.codecs.kernels.CHUNK


def n_examples(default: int) -> int:
    return FUZZ or default


def fuzz(default: int):
    """Hypothesis settings: reproducible, no database, health checks that only slow us down off,
    and no deadline (a wall-clock limit per example fails on a loaded machine; the work of each
    parser call is counted by :func:`bounded` instead)."""
    return settings(
        max_examples=n_examples(default),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
    )


# -- measurement ------------------------------------------------------------------------------------

STATS: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_stats():
    yield
    out = os.environ.get("UNICKPT_FUZZ_STATS")
    if out and STATS:
        Path(out).write_text(json.dumps(STATS, indent=2, sort_keys=True))


# Untyped exceptions of bugs that live in modules being fixed elsewhere, by (type, file, function)
# of the innermost unickpt frame: the properties count them as refusals (so they keep finding
# other bugs); their inputs are replayed from tests/attacks as non-strict xfails. Remove an
# entry once fixed.
KNOWN_BUGS: dict = {}


def known_bug(e: BaseException) -> str | None:
    tb, where = e.__traceback__, None
    while tb is not None:
        f = tb.tb_frame.f_code
        if os.path.basename(os.path.dirname(f.co_filename)) == "unickpt":
            where = (type(e).__name__, os.path.basename(f.co_filename), f.co_name)
        tb = tb.tb_next
    reason = KNOWN_BUGS.get(where) if where else None
    if reason:
        STATS.setdefault("known_bugs_hit", {}).setdefault(f"{where[1]}:{where[2]}: {reason}", 0)
        STATS["known_bugs_hit"][f"{where[1]}:{where[2]}: {reason}"] += 1
        if currently_in_test_context():
            note(f"known bug hit: {where}: {reason}")
    return reason


class TorchAllocations(TorchDispatchMode):
    """Counts the bytes of the tensors torch operations create while active: every aten
    op's outputs whose storage is none of its inputs' (views and in-place results share one),
    factory calls included. tracemalloc does not see torch's allocator; this does."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                n = t.untyped_storage().nbytes()
                self.bytes += n
                self.largest = max(self.largest, n)
        return out


_UNICKPT_DIR = os.path.dirname(os.path.abspath(unickpt.__file__)) + os.sep


def unickpt_calls(prof: cProfile.Profile) -> int:
    """The calls the library made: to its own functions, and from them to anything else
    (builtins, json, torch), each counted once. Work done inside other libraries' functions
    (an import that a first call triggers, torch's dispatch) is not counted: it is not the
    parser's per-input work."""
    n = 0
    for e in prof.getstats():
        if isinstance(e.code, str) or not e.code.co_filename.startswith(_UNICKPT_DIR):
            continue
        n += e.callcount
        n += sum(c.callcount for c in (e.calls or ()) if isinstance(c.code, str)
                 or not c.code.co_filename.startswith(_UNICKPT_DIR))
    return n


def bounded(name: str, size: int, fn, *args, mem: bool = True, limit: int | None = None, tensors: bool = False):
    """Call ``fn(*args)``: returns ``(result, None)`` or ``(None, typed error)``; anything else
    propagates (but see ``KNOWN_BUGS``). Checks the work, counted (never timed): the calls the
    library made (:func:`unickpt_calls`; ``CALLS_PER_BYTE`` x ``size`` + ``CALL_SLACK``); with
    ``mem``, the tracemalloc peak (``limit``, or ``MEM_FACTOR`` x ``size`` + ``MEM_SLACK``); with
    ``tensors``, the bytes torch operations allocate (``TORCH_FACTOR`` x ``size`` +
    ``TORCH_SLACK``; ``size``: the bytes read and written). The seconds are recorded in STATS,
    for information only."""
    base, own = 0, False
    if mem:
        own = not tracemalloc.is_tracing()  # traced only during the call: generation stays fast
        if own:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
    alloc = TorchAllocations() if tensors else contextlib.nullcontext()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    res, err = None, None
    try:
        with alloc:
            prof.enable()
            try:
                res = fn(*args)
            finally:
                prof.disable()
    except UnickptError as e:
        err = e
    except Exception as e:
        if not known_bug(e):
            raise
        err = e
    finally:
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] - base if mem else 0
        if own:
            tracemalloc.stop()
    calls = unickpt_calls(prof)
    s = STATS.setdefault(name, {"calls": 0, "max_seconds": 0.0, "max_ratio": 0.0, "max_peak": 0, "at_size": 0,
                                "max_fn_calls": 0, "max_calls_per_byte": 0.0, "max_torch_bytes": 0})
    s["calls"] += 1
    s["max_seconds"] = max(s["max_seconds"], dt)
    if mem and peak / max(size, 1) > s["max_ratio"] and size >= 4096:  # small inputs: the ratio is all slack
        s["max_ratio"], s["at_size"] = peak / max(size, 1), size
    s["max_peak"] = max(s["max_peak"], peak)
    s["max_fn_calls"] = max(s["max_fn_calls"], calls)
    if size >= 4096:
        s["max_calls_per_byte"] = max(s["max_calls_per_byte"], calls / size)
    cap = CALLS_PER_BYTE * size + CALL_SLACK
    assert calls <= cap, f"{name}: {calls} calls for a {size}-byte input (cap {cap})"
    if mem:
        cap = limit if limit is not None else MEM_FACTOR * size + MEM_SLACK
        assert peak <= cap, f"{name}: peak {peak} bytes for a {size}-byte input (cap {cap})"
    if tensors:
        s["max_torch_bytes"] = max(s["max_torch_bytes"], alloc.bytes)
        cap = TORCH_FACTOR * size + TORCH_SLACK
        assert alloc.bytes <= cap, (f"{name}: torch allocated {alloc.bytes} bytes (largest {alloc.largest}) "
                                    f"for {size} bytes in and out (cap {cap})")
    return res, err


class BytesReader:
    """A :class:`~unickpt.io.storage.RandomReader` over bytes in memory."""

    def __init__(self, data: bytes, path: str = "mem.safetensors", size: int | None = None) -> None:
        self.data = data
        self.path = path
        self.size = len(data) if size is None else size
        self.bytes_read = 0

    def readinto(self, offset: int, out) -> None:
        out = memoryview(out).cast("B")
        n = len(out)
        if offset < 0 or offset + n > self.size:
            raise _fmt.FormatError(f"{self.path}: read of {n} bytes at {offset} runs past the end ({self.size} bytes)")
        chunk = self.data[offset : offset + n]
        out[: len(chunk)] = chunk
        out[len(chunk) :] = bytes(n - len(chunk))  # a claimed size beyond the data reads zeros
        self.bytes_read += n

    def close(self) -> None:
        pass


# -- JSON mutation engine -----------------------------------------------------------------------------

HOSTILE_TEXT = [
    "null", "true", "false", "0", "-1", "1", "2", "4096", "2147483648", "9223372036854775808",
    str(2**64), str(2**70), "-" + str(2**70), "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1.5",
    "-0.0", "0.0", "1e-400", "1E2", '"x"', '""', '"\\u0000\\u001f\\n"', '"\\ud800"', '"' + "A" * 5000 + '"',
    "[]", "{}", "[[]]", "[0,0]", "[-1,1]", "[0,0,0,0,0]", '[[0,0,"0000000000000000"]]', '{"a":{"b":[1,{}]}}',
    "9" * 5000, "[" * 2000 + "]" * 2000, '{"x":' * 1500 + "1" + "}" * 1500, '"../../etc/passwd"',
    '"model-00001-of-00001.safetensors"', '"raw"', '"residual16"', '"from_model"', '"q4_sym"', '"q8_rinv"',
    '"F32"', '"BF16"', '"I16"', '"model"', '"zstd"', '"plain"', "[0,4096,0,1,1]", "[[0,1,2,3,4]]",
]

SCALARS = (
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8
)
FRAGMENTS = st.one_of(st.sampled_from(HOSTILE_TEXT), JSON_VALUES.map(lambda v: json.dumps(v)))


# fields whose values turn into offsets, sizes or decoding work: edited more often
HOT_KEYS = {"codec", "codec_args", "parts", "frames", "offsets", "data_offsets", "shape", "dtype", "file", "exceptions",
            "model", "group", "eps", "size", "data_start", "stored_size", "container", "checksums", "key", "format_version"}


def paths_of(o, path=()):
    yield path
    if isinstance(o, dict):
        for k, v in o.items():
            yield from paths_of(v, path + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from paths_of(v, path + (i,))


def get_at(o, path):
    for p in path:
        o = o[p]
    return o


def strings_of(o) -> list[str]:
    out = []
    for p in paths_of(o):
        v = get_at(o, p)
        if isinstance(v, str):
            out.append(v)
        if p and isinstance(p[-1], str):
            out.append(p[-1])
    return out


def near_miss(draw, v, pool: list[str]):
    """A value of (mostly) the same type, close to ``v``: reaches the deep checks."""
    if type(v) is int:
        return json.dumps(draw(st.sampled_from([v + 1, v - 1, -v - 1, 0, -1, v * 2, v + 4096, v - 4096, 2**31, 2**63,
                                                 2**64 + v, 2**70, 1 << 30, 64 << 20, (64 << 20) + 1])))
    if isinstance(v, float):
        return json.dumps(draw(st.sampled_from([v * 2, -v, 0.0, 1e-300, 1e300, 1.0, 1])))
    if isinstance(v, str):
        cands = ["", v + "x", v[:-1], v.upper(), "../" + v, v + "\x00", v * 3, "A" * 300] + pool[:200]
        return json.dumps(draw(st.sampled_from(cands)))
    if isinstance(v, list):
        cands = [[], v[:-1], v + v[-1:], v[::-1], [v], v[1:] + v[:1]]
        return json.dumps(draw(st.sampled_from(cands)))
    if isinstance(v, dict):
        keys = sorted(v)
        if not keys:
            return "[]"
        k = draw(st.sampled_from(keys))
        return json.dumps({kk: vv for kk, vv in v.items() if kk != k})
    return draw(FRAGMENTS)


def emit(o, path, edits) -> str:
    """JSON text of ``o`` with ``edits`` applied: path -> (op, text) with op in replace,
    delete, rename (the key), dup (the member or element once more, with ``text`` as value),
    add (a member ``text[0]: text[1]`` or an element ``text[1]`` at the end)."""
    ed = edits.get(path)
    if ed is not None and ed[0] == "replace":
        return ed[1]
    add = ed[1] if ed is not None and ed[0] == "add" else None
    if isinstance(o, dict):
        items = []
        for k, v in o.items():
            p = path + (k,)
            e = edits.get(p)
            if e is not None and e[0] == "delete":
                continue
            key = e[1] if e is not None and e[0] == "rename" else k
            items.append(json.dumps(key) + ":" + emit(v, p, edits))
            if e is not None and e[0] == "dup":
                items.append(json.dumps(key) + ":" + e[1])
        if add is not None:
            items.append(json.dumps(add[0]) + ":" + add[1])
        return "{" + ",".join(items) + "}"
    if isinstance(o, list):
        items = []
        for i, v in enumerate(o):
            p = path + (i,)
            e = edits.get(p)
            if e is not None and e[0] == "delete":
                continue
            items.append(emit(v, p, edits))
            if e is not None and e[0] == "dup":
                items.append(e[1])
        if add is not None:
            items.append(add[1])
        return "[" + ",".join(items) + "]"
    return json.dumps(o)


@st.composite
def json_edits(draw, doc, max_edits: int = 3):
    """1..max_edits structural edits of ``doc``."""
    paths = list(paths_of(doc))
    hot = [p for p in paths if p and isinstance(p[-1], str) and p[-1] in HOT_KEYS] or paths
    pool = strings_of(doc) or [""]
    edits = {}
    for _ in range(draw(st.integers(1, max_edits))):
        p = draw(st.sampled_from(hot if draw(st.booleans()) else paths))
        v = get_at(doc, p)
        ops = (["replace", "near"] + (["delete", "dup"] if p else []) + (["rename"] if p and isinstance(p[-1], str) else [])
               + (["add"] if isinstance(v, (dict, list)) else []))
        op = draw(st.sampled_from(ops))
        if op == "replace":
            edits[p] = ("replace", draw(FRAGMENTS))
        elif op == "near":
            edits[p] = ("replace", near_miss(draw, v, pool))
        elif op == "delete":
            edits[p] = ("delete", "")
        elif op == "dup":
            edits[p] = ("dup", draw(st.one_of(st.just(json.dumps(v)), st.just(near_miss(draw, v, pool)), FRAGMENTS)))
        elif op == "add":
            key = draw(st.sampled_from(sorted(HOT_KEYS) + ["x", ""]) | st.sampled_from(pool[:100]))
            value = st.sampled_from(list(_cp.names()) + pool[:100]).map(json.dumps)
            edits[p] = ("add", (key, draw(value | FRAGMENTS)))
        else:
            edits[p] = ("rename", draw(st.sampled_from(["", p[-1] + "x", p[-1].upper(), "../x"] + pool[:100])))
    note(f"edits: {[(k, v[0], str(v[1])[:80]) for k, v in edits.items()]}")
    return edits


@st.composite
def byte_damage(draw, data: bytes) -> bytes:
    """Bit flips, byte sets, insertions, deletions, truncation of ``data``."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not buf and op != "insert":
            op = "insert"
        i = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[i : i + draw(st.integers(1, 8))]
        else:
            del buf[i:]
    return bytes(buf)


# -- manifest helpers ---------------------------------------------------------------------------------

DIGEST_KEY = getattr(_mf, "DIGEST_KEY", None)


def seal(text: bytes) -> bytes:
    """Re-seal a manifest body with the digest the current manifest format uses (none before
    format 2): a forger's (or a buggy writer's) manifest, consistent with itself."""
    if DIGEST_KEY is None or not text.endswith(b"}") or not text.startswith(b"{") or text == b"{}":
        return text
    return text[:-1] + b',"' + DIGEST_KEY.encode() + b'":"' + xxhash.xxh3_128_hexdigest(text).encode() + b'"}'


def unseal(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    if DIGEST_KEY:
        doc.pop(DIGEST_KEY, None)
    return doc


def v1(doc: dict) -> dict:
    """The same manifest in format 1 (no self-checksums): still readable, so its deep checks
    are reachable without a digest."""
    doc = unseal(doc)
    doc["format_version"] = 1
    for f in doc.get("files", {}).values():
        if isinstance(f, dict):
            f.pop("header_xxh3", None)
    doc.pop("aux", None)
    return doc


def manifest_invariants(m) -> None:
    """What the readers rely on once a manifest is accepted."""
    for (role, name), t in m.tensors.items():
        assert t.file in m.files, (role, name)
        fe = m.files[t.file]
        data_len = fe.size - fe.data_start
        assert 0 <= t.begin <= t.end <= data_len
        for _, _key, dt, shape, b, e, sums in t.stored():
            assert 0 <= b <= e <= data_len
            assert e - b == math.prod(shape) * _fmt.itemsize(dt)
            pos = 0
            for cb, ce, _ in sums:
                assert cb == pos and ce > cb
                pos = ce
            assert pos in (0, e - b)
        if t.codec == "raw":
            assert t.end - t.begin == t.numel * _fmt.itemsize(t.dtype)
            continue
        tag = t.tag
        assert tag["codec"] == t.codec, f"{name}: tag codec {tag['codec']!r} but entry codec {t.codec!r}"
        if t.codec in ("residual16", "from_model"):
            mt = m.tensors[("model", t.args["model"])]
            assert mt.shape == t.shape and mt.codec == "raw"
        if t.codec == "from_model":
            continue
        ranges = _cp.byte_ranges(tag, 0, t.numel)
        assert set(ranges) == set(t.parts), (name, ranges, sorted(t.parts))
        for p, (b, e) in ranges.items():
            assert 0 <= b <= e <= t.parts[p].nbytes, (name, p, b, e, t.parts[p].nbytes)
        if t.codec == "residual16":
            idx, bits = t.exceptions
            assert idx.numel() == bits.numel()
    blob = m.to_json()  # an accepted manifest can be written again (offline tools do)
    again = _mf.Manifest.from_json(blob, "again")
    assert again.tensors.keys() == m.tensors.keys()


# -- checkpoints ----------------------------------------------------------------------------------------


def _plain_state():
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(6, 10, generator=g), "b": torch.randn(10, generator=g).to(torch.bfloat16),
                  "i": torch.arange(12, dtype=torch.int64).reshape(3, 4)},
        "other": {"s": torch.tensor(3.5), "e": torch.zeros(0, 3)},
    }


def _compressed_state():
    g = torch.Generator().manual_seed(0)
    sd = {"model": {}, "master": {}, "optimizer": {}}
    for n, sh in {"w": (6, 40), "b": (40,), "c": (3, 7), "s": (1,)}.items():
        m = torch.randn(sh, generator=g)
        sd["master"][n] = m
        sd["model"][n] = m.to(torch.bfloat16)
        sd["optimizer"][n + ".exp_avg"] = torch.randn(sh, generator=g) * 1e-3
        sd["optimizer"][n + ".exp_avg_sq"] = torch.rand(sh, generator=g) * 1e-6
    return sd


def _fresh(sd):
    return {r: {n: torch.zeros_like(t) for n, t in g.items()} for r, g in sd.items()}


def _bits(sd):
    return {(r, n): t.contiguous().reshape(-1).view(torch.uint8).clone()
            for r, g in sd.items() for n, t in g.items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (directory, state dict, values loaded from the intact checkpoint)."""
    root = tmp_path_factory.mktemp("fuzz-ckpt")
    out = {}
    for name, sd, kw in [("plain", _plain_state(), {}),
                         ("o1", _compressed_state(), dict(quant="O1", master="residual", zstd=3))]:
        d = root / name
        unickpt.save(sd, d, **kw)
        t = _fresh(sd)
        unickpt.load(t, d, group="local")
        out[name] = (d, sd, _bits(t))
        # the same checkpoint in format 1 (no manifest, header or aux checksums): still read,
        # so damage reaches the parsers instead of a checksum
        d1 = root / f"{name}-v1"
        shutil.copytree(d, d1)
        (d1 / "unickpt.json").write_bytes(json.dumps(v1(json.loads((d / "unickpt.json").read_bytes()))).encode())
        t = _fresh(sd)
        unickpt.load(t, d1, group="local")
        out[f"{name}-v1"] = (d1, sd, _bits(t))
    return out


@pytest.fixture(scope="module")
def manifests(ckpts):
    return {k: json.loads((d / "unickpt.json").read_bytes()) for k, (d, _, _) in ckpts.items()}


# == 1. safetensors headers ===========================================================================


def _header_bytes(obj, n_override=None) -> bytes:
    raw = json.dumps(obj).encode() if not isinstance(obj, (bytes, str)) else (obj.encode() if isinstance(obj, str) else obj)
    return struct.pack("<Q", len(raw) if n_override is None else n_override) + raw


def _check_header(prefix: bytes, file_size: int):
    res, err = bounded("format.parse_header", len(prefix), _fmt.parse_header, "fuzz.safetensors", prefix, file_size)
    if res is not None:  # accepted: tensors tile the data section inside the file
        assert res.data_start >= 8 and res.data_start <= file_size
        pos = 0
        for info in sorted(res.tensors.values(), key=lambda i: (i.begin, i.end)):
            assert info.begin == pos and info.end - info.begin == math.prod(info.shape) * _fmt.itemsize(info.dtype)
            pos = info.end
        assert res.data_start + pos == file_size
    return res, err


@fuzz(300)
@given(prefix=st.binary(max_size=300), extra=st.integers(-16, 1 << 20))
def test_header_raw_bytes(prefix, extra):
    _check_header(prefix, max(len(prefix) + extra, 0))


_TENSOR = st.fixed_dictionaries(
    {"dtype": st.sampled_from(sorted(_fmt.DTYPES)), "shape": st.lists(st.integers(0, 5), max_size=3)}
)


@st.composite
def valid_headers(draw):
    """A consistent header object and its data length (tensors in a random order)."""
    specs = draw(st.dictionaries(st.text(min_size=1, max_size=8), _TENSOR, max_size=5))
    meta = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
    obj, pos = {"__metadata__": meta} if draw(st.booleans()) else {}, 0
    for name, t in specs.items():
        if name == "__metadata__":
            continue
        n = math.prod(t["shape"]) * _fmt.itemsize(t["dtype"])
        obj[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [pos, pos + n]}
        pos += n
    return obj, pos


@fuzz(400)
@given(data=st.data(), hv=valid_headers(), pad=st.integers(0, 40), slack=st.sampled_from([0, 0, 0, 1, -1, 4096]))
def test_header_structured(data, hv, pad, slack):
    obj, data_len = hv
    edits = data.draw(json_edits(obj)) if data.draw(st.booleans()) else {}
    raw = emit(obj, (), edits).encode() + b" " * pad
    n = data.draw(st.sampled_from([len(raw)] * 6 + [0, len(raw) - 1, len(raw) + 1, 2**63, 2**64 - 1, _fmt.HEADER_LIMIT + 1]))
    prefix = struct.pack("<Q", n) + raw
    res, err = _check_header(prefix, max(len(prefix) + data_len + slack, 0))
    if not edits and slack == 0 and n == len(raw):
        assert err is None, err


@fuzz(200)
@given(data=st.data())
def test_header_real_damaged(ckpts, data):
    d, _, _ = ckpts["plain"]
    f = d / "model-00001-of-00001.safetensors"
    blob = f.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    head = data.draw(byte_damage(blob[: 8 + n]))
    size = len(blob) - (8 + n) + len(head)
    _check_header(head, size)
    # and through read_header, on a reader of the damaged file
    bounded("format.read_header", len(head), _fmt.read_header, BytesReader(head + blob[8 + n :]))


def _refused_without_huge_products(name: str, data: bytes, parse) -> None:
    """Many large dimensions in one shape: refused (typed), the size check linear in the
    number of dimensions, not quadratic: no product of more than ``MAX_DIMS`` dimensions, nor
    one past 64 bits (``math.prod`` of 10,000 62-bit numbers is a 620,000-bit integer built
    one multiplication at a time), and the calls made bounded by :func:`bounded`. Counted,
    not timed: ``bench/parse_dos.py`` times these inputs."""
    products = []
    real_prod = math.prod

    def counting_prod(iterable, *a, **kw):
        factors = list(iterable)
        out = real_prod(factors, *a, **kw)
        products.append((len(factors), out.bit_length() if type(out) is int else 0))
        return out

    math.prod = counting_prod  # the parsers call math.prod through the module: every call is seen
    try:
        _, err = bounded(name, len(data), parse, data)
    finally:
        math.prod = real_prod
    assert isinstance(err, UnickptError), f"{name}: accepted"
    wide = [(n, bits) for n, bits in products if n > _fmt.MAX_DIMS or bits > 64]
    assert not wide, f"{name}: products of (factors, bits) {wide[:5]} for {len(data)} bytes"


def _huge_dims_header(ndims: int) -> bytes:
    """A safetensors file whose one tensor has ``ndims`` dimensions of 2^62 - 1."""
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [(1 << 62) - 1] * ndims, "data_offsets": [0, 4]}}).encode()
    return struct.pack("<Q", len(hdr)) + hdr + bytes(4)


@pytest.mark.parametrize("what", ["attack", "max-dims"])
def test_header_huge_dims_refused_without_huge_products(what):
    data = _payload(ATTACKS / "header/huge_dims.bin.zst") if what == "attack" else _huge_dims_header(_fmt.MAX_DIMS)
    _refused_without_huge_products(f"format.parse_header[huge_dims {what}]", data,
                                   lambda d: _fmt.parse_header("x", d, len(d)))


# == 2. manifests ==========================================================================================


def _check_manifest(data: bytes, invariants: bool = True):
    res, err = bounded("manifest.from_json", len(data), _mf.Manifest.from_json, data, "fuzz/unickpt.json")
    if res is not None and invariants:
        manifest_invariants(res)
    return res, err


@fuzz(300)
@given(data=st.binary(max_size=400))
def test_manifest_raw_bytes(data):
    _check_manifest(data)


@fuzz(300)
@given(data=st.data(), which=st.sampled_from(["plain", "o1", "plain-v1", "o1-v1"]))
def test_manifest_real_damaged_bytes(manifests, ckpts, data, which):
    """Byte damage of a real (sealed) manifest: typed errors only. Whether damage is detected
    is :func:`test_manifest_damage_detected`."""
    blob = (ckpts[which][0] / "unickpt.json").read_bytes()
    _check_manifest(data.draw(byte_damage(blob)))


@fuzz(150)
@given(data=st.data(), which=st.sampled_from(["plain", "o1"]))
def test_manifest_damage_detected(manifests, ckpts, data, which):
    blob = (ckpts[which][0] / "unickpt.json").read_bytes()
    bad = data.draw(byte_damage(blob))
    assume(bad != blob)
    try:
        m = _mf.Manifest.from_json(bad, "x")
    except UnickptError:
        return
    good = _mf.Manifest.from_json(blob, "x")
    # accepted: the damage must not have changed anything a reader uses
    assert m.to_json() == good.to_json()


@fuzz(500)
@given(data=st.data(), which=st.sampled_from(["plain", "o1"]), fmt1=st.booleans())
def test_manifest_structured(manifests, data, which, fmt1):
    """Type swaps, near misses, deletions, duplicates and renames anywhere in a real manifest,
    re-sealed (or as format 1) so that the checks behind the digest are reached."""
    doc = v1(manifests[which]) if fmt1 else unseal(manifests[which])
    edits = data.draw(json_edits(doc))
    text = emit(doc, (), edits).encode()
    _check_manifest(text if fmt1 else seal(text))


@pytest.mark.parametrize("value", list(_cp.names() + (5, None, "")))
def test_manifest_codec_args_cannot_change_codec(manifests, value):
    """``codec_args`` holding a ``codec`` of its own, in every coded tensor: refused, or the
    tensor decodes with its own codec (a residual16 master whose tag says from_model crashes
    the loader with a KeyError; see tests/attacks/manifest/codec_args_residual_as_from_model.json)."""
    doc = v1(manifests["o1"])
    for role, group in doc["tensors"].items():
        for name, t in group.items():
            if "codec_args" not in t:
                continue
            d = copy.deepcopy(doc)
            d["tensors"][role][name]["codec_args"]["codec"] = value
            _check_manifest(json.dumps(d).encode())


@pytest.mark.parametrize("size", [1 << 19])
def test_parse_memory_worst_case(size):
    """Worst-case JSON shapes of ~1 MiB (tests/crafted.worst_case_json), as a manifest and as a
    safetensors header: peak memory and calls made per input byte stay bounded (counted by
    :func:`bounded`; how long they take: bench/parse_dos.py)."""
    for label, doc, prefix in worst_case_inputs(size):
        bounded(f"manifest.from_json[{label}]", len(doc), _mf.Manifest.from_json, doc, "x")
        bounded(f"format.parse_header[{label}]", len(prefix), _fmt.parse_header, "x", prefix, len(prefix))


def _huge_dims_manifest(ndims: int) -> bytes:
    """The attack manifest with its shape cut to ``ndims`` dimensions of 2^62 - 1."""
    doc = json.loads(_payload(ATTACKS / "manifest/huge_dims.json.zst"))
    doc["tensors"]["model"]["w"]["shape"] = [(1 << 62) - 1] * ndims
    return json.dumps(doc).encode()


@pytest.mark.parametrize("what", ["attack", "max-dims"])
def test_manifest_huge_dims_refused_without_huge_products(what):
    data = _payload(ATTACKS / "manifest/huge_dims.json.zst") if what == "attack" else _huge_dims_manifest(_fmt.MAX_DIMS)
    _refused_without_huge_products(f"manifest.from_json[huge_dims {what}]", data, lambda d: _mf.Manifest.from_json(d, "x"))


# == 3. zstd-framed files =====================================================================================

_BOMB: dict[str, bytes] = {}


def bomb(kind: str) -> bytes:
    """zstd frames that decompress to far more than any frame may hold (64 MiB of zeros)."""
    if kind not in _BOMB:
        zero = bytes(1 << 20)
        if kind == "nosize":  # no content size in the frame header
            c = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
            _BOMB[kind] = b"".join(c.compress(zero) for _ in range(64)) + c.flush()
        elif kind == "liar":  # declares 1 KiB, holds 64 MiB
            _BOMB[kind] = _with_content_size(bomb("nosize"), 1024)
        elif kind == "two":  # a correct frame of 1 KiB followed by a 64 MiB one
            _BOMB[kind] = zstandard.ZstdCompressor(level=1).compress(bytes(1024)) + bomb("nosize")
        else:  # skippable frame then garbage
            _BOMB[kind] = struct.pack("<II", 0x184D2A50, 8) + bytes(8) + bomb("nosize")
    return _BOMB[kind]


def _with_content_size(frame: bytes, size: int) -> bytes:
    """Rewrite a frame header (no dictionary, no content size) to declare ``size`` bytes (2-byte FCS field)."""
    fhd = frame[4]
    assert fhd & 0xC0 == 0 and fhd & 0x03 == 0 and not fhd & 0x20
    new = (fhd & 0x3F) | 0x40  # FCS_Field_Size flag 1: 2 bytes, value - 256
    wd = frame[5:6]
    return frame[:4] + bytes([new]) + wd + struct.pack("<H", size - 256) + frame[6:]


@st.composite
def framed_files(draw):
    """(logical bytes, stored bytes, frames table): a valid framed file, frames stored in a random order."""
    kind = draw(st.sampled_from(["random", "zeros", "text"]))
    n = draw(st.integers(1, 6000))
    if kind == "random":
        logical = random.Random(draw(st.integers(0, 2**32))).randbytes(n)
    elif kind == "zeros":
        logical = bytes(n)
    else:
        logical = (b"unickpt checkpoint frame " * (n // 25 + 1))[:n]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=5))) - {n})
    bounds = [0] + [c for c in cuts if 0 < c < n] + [n]
    pieces = []
    for b, e in zip(bounds, bounds[1:]):
        raw = logical[b:e]
        comp = zstandard.ZstdCompressor(level=1).compress(raw)
        z = draw(st.booleans()) and len(comp) <= len(raw)  # (writers keep a coded frame only when it is smaller)
        pieces.append((b, e, comp if z else raw, int(z)))
    order = draw(st.permutations(range(len(pieces))))
    stored, frames, off = b"", [None] * len(pieces), 0
    for i in order:
        b, e, blob, z = pieces[i]
        frames[i] = [b, e, off, len(blob), z]
        stored += blob
        off += len(blob)
    return logical, stored, frames


def _read_all(reader, size, ranges):
    out = []
    for a, b in ranges:
        buf = bytearray(b - a)
        reader.readinto(a, memoryview(buf))
        out.append(bytes(buf))
    return out


def _check_framed(logical_size: int, stored: bytes, frames, size: int, stored_size: int, ranges):
    """Open and read a framed file: typed errors only, memory bounded by frames, not claims."""
    inner = BytesReader(stored, "fuzz.safetensors")
    frame_max = max((f[1] - f[0] for f in (frames if isinstance(frames, list) else [])
                     if isinstance(f, list) and len(f) == 5 and all(type(x) is int for x in f)), default=0)
    frame_max = min(max(frame_max, 0), _ct.FRAME_MAX)
    cap = (_ct.ZstdReader.CACHE + 2) * (frame_max + 1) + 4 * len(stored) + 2 * sum(b - a for a, b in ranges) + MEM_SLACK

    def run():
        r = _ct.ZstdReader(inner, frames, size, stored_size)
        return _read_all(r, size, [(a, b) for a, b in ranges if b <= size])

    return bounded("container.ZstdReader", len(stored) + len(json.dumps(frames)), run, limit=cap)


@fuzz(300)
@given(ff=framed_files(), data=st.data())
def test_container_valid_and_hostile(ff, data):
    logical, stored, frames = ff
    size, ssize = len(logical), len(stored)
    frames = copy.deepcopy(frames)
    mutated = data.draw(st.booleans())
    if mutated:
        for _ in range(data.draw(st.integers(1, 3))):
            op = data.draw(st.sampled_from(["int", "flag", "swap", "dup", "drop", "stored", "size", "bomb", "byte"]))
            i = data.draw(st.integers(0, len(frames) - 1)) if frames else 0
            if op == "int" and frames:
                j = data.draw(st.integers(0, 4))
                frames[i][j] = data.draw(st.sampled_from([0, -1, 1, frames[i][j] + 1, frames[i][j] - 1, 2**63, 2**70,
                                                          _ct.FRAME_MAX, _ct.FRAME_MAX + 1, ssize, size]))
            elif op == "flag" and frames:
                frames[i][4] ^= 1
            elif op == "swap" and len(frames) > 1:
                k = data.draw(st.integers(0, len(frames) - 1))
                frames[i][2:4], frames[k][2:4] = frames[k][2:4], frames[i][2:4]
            elif op == "dup" and frames:
                frames.insert(i, list(frames[i]))
            elif op == "drop" and frames:
                del frames[i]
            elif op == "stored":
                ssize = data.draw(st.sampled_from([ssize + 1, ssize - 1, 0, 2**40]))
            elif op == "size":
                size = data.draw(st.sampled_from([size + 1, size - 1, 0, 2**40]))
            elif op == "bomb" and frames:
                # replace frame i's stored bytes by a bomb, the table adjusted to the bomb's length
                bk = data.draw(st.sampled_from(["nosize", "liar", "two", "skip"]))
                b, e, off, n, _ = frames[i]
                blob = bomb(bk)
                stored = stored[:off] + blob + stored[off + n :]
                delta = len(blob) - n
                for f in frames:
                    if f[2] > off:
                        f[2] += delta
                frames[i] = [b, e, off, len(blob), 1]
                ssize += delta
            elif op == "byte" and stored:
                k = data.draw(st.integers(0, len(stored) - 1))
                stored = stored[:k] + bytes([stored[k] ^ data.draw(st.integers(1, 255))]) + stored[k + 1 :]
    # also: a table that is not even a list of lists
    if data.draw(st.integers(0, 19)) == 0:
        frames, mutated = data.draw(JSON_VALUES), True
    ranges = [(0, max(min(size, len(logical) * 2), 0))]
    for _ in range(data.draw(st.integers(0, 3))):
        a = data.draw(st.integers(0, max(size, 0) if size < 2**32 else 10))
        b = data.draw(st.integers(a, a + 3000))
        ranges.append((a, b))
    res, err = _check_framed(len(logical), stored, frames, size, ssize, ranges)
    if not mutated:
        assert err is None, err
        for (a, b), got in zip([r for r in ranges if r[1] <= size], res):
            assert got == logical[a:b]
    if res is not None:
        assert [len(x) for x in res] == [b - a for a, b in ranges if b <= size]


@fuzz(200)
@given(frames=JSON_VALUES | st.lists(st.lists(st.integers(-5, 2**70), min_size=5, max_size=5), max_size=6),
       size=st.integers(-5, 2**70), stored=st.integers(-5, 2**70))
def test_check_frames_tables(frames, size, stored):
    res, err = bounded("container.check_frames", len(json.dumps(frames)), _ct.check_frames, frames, size, stored, "x")
    if res is not None:  # accepted: frames tile the logical bytes, stored ranges tile the file
        assert sum(e - b for b, e, *_ in res) == size
        assert sum(n for *_, n, _ in res) == stored
        assert all(0 < e - b <= _ct.FRAME_MAX for b, e, *_ in res)


@pytest.mark.parametrize("kind", ["nosize", "liar", "two", "skip"])
def test_container_bombs(kind):
    """A frame whose content is far larger than its table entry says: rejected after reading
    at most one byte more than declared (memory stays bounded)."""
    blob = bomb(kind)
    logical = 1024
    frames = [[0, logical, 0, len(blob), 1]]
    res, err = _check_framed(logical, blob, frames, logical, len(blob), [(0, logical)])
    if kind == "two" and res is not None:  # a correct first frame: trailing frames are ignored
        assert res == [bytes(1024)]
    else:
        assert err is not None


# == 4. codec metadata ========================================================================================

CODEC_NAMES = list(QUANT_CODECS) + ["residual16", "from_model", "raw", "", "q8", "q16_sym", 5, None, ["q8_sym"]]
GROUPS = st.one_of(st.integers(-3, 70), st.sampled_from([2**20, 2**20 + 2, 2**40, 2**70, True, False, 1.5, None, "64", [64]]))
EPS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1, -1, None, "1e-8", True]))


@st.composite
def codec_tags(draw):
    tag = {"codec": draw(st.sampled_from(CODEC_NAMES))}
    if draw(st.integers(0, 9)):
        tag["group"] = draw(GROUPS)
    if draw(st.integers(0, 3)):
        tag["eps"] = draw(EPS)
    if draw(st.integers(0, 3)):
        tag["ratio"] = draw(st.one_of(EPS, st.sampled_from([1.5, 1.0, 16.0, 17.0])))
    if draw(st.booleans()):
        tag["seed"] = draw(st.sampled_from([0, -1, 1 << 63, (1 << 63) - 1, 1.5, None, "7"]))
    if draw(st.booleans()):
        tag["model"] = draw(st.sampled_from(["w", 5, None]))
    return tag


def _decode_inputs(tag, shape, lo, hi, data):
    """Part bytes of the sizes byte_ranges asks for (random content), model and exceptions."""
    ranges = _cp.byte_ranges(tag, lo, hi)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    parts = {p: torch.frombuffer(bytearray(rng.randbytes(e - b)) or bytearray(1), dtype=torch.uint8)[: e - b]
             for p, (b, e) in ranges.items()}
    model = torch.randn(hi - lo).to(torch.bfloat16)
    n = math.prod(shape)
    idx = sorted(set(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=4)))) if n else []
    exc = (torch.tensor(idx, dtype=torch.int64), torch.tensor([0x7FC00001] * len(idx), dtype=torch.int32))
    return parts, model, exc


def _io_bytes(lo, hi, *tensors) -> int:
    """Bytes a decode of [lo, hi) reads (``tensors``: dicts, tuples or tensors) and writes (fp32)."""
    flat = [t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor)]
    return 4 * (hi - lo) + sum(t.numel() * t.element_size() for t in flat)


@fuzz(400)
@given(tag=codec_tags(), shape=st.lists(st.integers(0, 40), max_size=3), data=st.data())
def test_codec_hostile_tags(tag, shape, data):
    """parts_of / byte_ranges / decode_range with any tag: typed errors or a result of the
    right size (never KeyError, ZeroDivisionError, AttributeError...)."""
    shape = tuple(shape)
    n = math.prod(shape)
    bounded("codecs.parts_of", 64, _cp.parts_of, tag, shape, mem=False, tensors=True)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    ranges, err = bounded("codecs.byte_ranges", 64, _cp.byte_ranges, tag, lo, hi, mem=False, tensors=True)
    if err is not None:
        return
    parts, model, exc = _decode_inputs(tag, shape, lo, hi, data)
    out, err = bounded("codecs.decode_range", _io_bytes(lo, hi, parts, model, exc), _cp.decode_range, tag, parts,
                       lo, hi, model, exc, mem=False, tensors=True)
    if out is not None:
        assert out.numel() == hi - lo and out.dtype == torch.float32


@st.composite
def valid_tags(draw):
    codec = draw(st.sampled_from(list(QUANT_CODECS) + ["residual16"]))
    shape = tuple(draw(st.lists(st.integers(0, 30), min_size=1, max_size=3)))
    if codec == "residual16":
        return {"codec": codec, "model": "w"}, shape
    bits = 8 if codec.startswith("q8") else 4
    g = unickpt.codecs.kernels.group_size(shape, bits, draw(st.sampled_from([2, 4, 64, 6])))
    tag = {"codec": codec, "group": g}
    if codec.endswith(("rinv", "logw")):
        tag["eps"] = draw(st.sampled_from([1e-8, 1e-30, 1e30, 5e-324]))
    if codec == "q4_logm":
        tag["ratio"] = draw(st.sampled_from([1.5, 1.0001, 16.0, 2]))
    return tag, shape


@fuzz(300)
@given(ts=valid_tags(), data=st.data())
def test_codec_valid_tags_hostile_bytes(ts, data):
    """Valid tags, any stored bytes (NaN/inf scales, min > max, any codes): decoding any
    range returns the range, or refuses scales no encoder writes with a FormatError saying
    so (never another exception); part bytes of the wrong length: typed error."""
    tag, shape = ts
    n = math.prod(shape)
    parts = {p: sh for p, _, sh in _cp.parts_of(tag, shape)} if tag["codec"] != "residual16" else {"low16": shape}
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    inputs = _decode_inputs(tag, shape, lo, hi, data)
    assert set(inputs[0]) == set(parts)
    out, err = bounded("codecs.decode_range", _io_bytes(lo, hi, inputs), _cp.decode_range, tag, *inputs[:1], lo, hi,
                       *inputs[1:], mem=False, tensors=True)
    if err is not None:
        assert isinstance(err, FormatError) and "no encoder writes one" in str(err), err
        return
    assert out.numel() == hi - lo
    if hi > lo and data.draw(st.booleans()):  # one part a byte short or long
        p = data.draw(st.sampled_from(sorted(inputs[0])))
        bad = dict(inputs[0])
        bad[p] = torch.cat([bad[p], torch.zeros(1, dtype=torch.uint8)]) if data.draw(st.booleans()) else bad[p][:-1]
        bounded("codecs.decode_range", _io_bytes(lo, hi, bad, inputs[1:]), _cp.decode_range, tag, bad, lo, hi,
                *inputs[1:], mem=False, tensors=True)


@pytest.mark.parametrize("codec", QUANT_CODECS)
def test_codec_long_groups_bounded(codec):
    """A group longer than a decoding chunk (a long q8 row; a hostile group up to MAX_GROUP):
    decoding a few elements needs scratch for those elements, not for the group (it used
    to allocate 8 x group bytes: 8 TiB for group 2^40), and long-group decoding gives the same
    bits as the buffered path. The scratch is counted (bytes torch allocates, tracemalloc's
    peak for numpy and Python), not timed."""
    group = 1 << 40 if codec.startswith("q8") else _cp.MAX_BLOCK
    tag = {"codec": codec, "group": group, "eps": 1e-8, "ratio": 1.5}
    lo, hi = group - 3, group + 2  # across a group boundary
    parts = {p: torch.full((e - b,), 7, dtype=torch.uint8) for p, (b, e) in _cp.byte_ranges(tag, lo, hi).items()}
    parts["scales"] = torch.ones(parts["scales"].numel() // 4).view(torch.uint8)  # valid scales (m), w in [1, 1]
    with TorchAllocations():  # once untraced: first-call imports (the dispatch mode's: torch._dynamo) are not scratch
        _cp.decode_range(tag, parts, lo, hi)
    tracemalloc.start()
    try:
        with TorchAllocations() as alloc:
            out = _cp.decode_range(tag, parts, lo, hi)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.numel() == hi - lo
    # a few elements: kilobytes; one group's worth of scratch would be >= 8 MiB (q4: 8 x 2^20 bytes)
    assert alloc.largest <= 4096 and alloc.bytes <= 64 << 10, (alloc.bytes, alloc.largest)
    assert peak <= 1 << 20, peak
    # bit-identical to the buffered path on a long (but allocatable) row
    C = unickpt.codecs.kernels
    g = torch.Generator().manual_seed(3)
    bits = 8 if codec.startswith("q8") else 4
    group = C.CHUNK + 6
    x = torch.randn(2 * group + 100, generator=g)
    if codec.endswith(("rinv", "logw")):
        x = x.square() * 1e-4
        enc = C.encode_v if codec.endswith("rinv") else C.encode_w
        codes, a, b = enc(x, bits, group, 1e-8)
        scales = torch.stack([a, b], dim=1)
    elif codec == "q4_logm":
        codes, scales = C.encode_mlog(x, group)
    else:
        codes, scales = C.encode_m(x, bits, group)
    tag = {"codec": codec, "group": group, "eps": 1e-8, "ratio": C.M_RATIO}
    for lo, hi in [(0, x.numel()), (group - 5, group + 12), (group + 1, 2 * group + 3)]:
        rng = _cp.byte_ranges(tag, lo, hi)
        parts = {"codes": codes.view(torch.uint8)[rng["codes"][0] : rng["codes"][1]],
                 "scales": scales.reshape(-1).view(torch.uint8)[rng["scales"][0] : rng["scales"][1]]}
        fast = _cp.decode_range(tag, parts, lo, hi)
        old = C.CHUNK
        C.CHUNK = 1 << 21  # > group: the buffered path
        try:
            slow = _cp.decode_range(tag, parts, lo, hi)
        finally:
            C.CHUNK = old
        assert torch.equal(fast.view(torch.int32), slow.view(torch.int32)), (lo, hi)


# == 5. end to end: damaged checkpoint directories ============================================================


def _outcome(d: Path, sd, good):
    """Load into fresh targets, verify and inspect with the CLI; every error typed."""
    t = _fresh(sd)
    t0 = time.perf_counter()
    try:
        unickpt.load(t, d, group="local")
        err = None
    except UnickptError as e:
        err = e
    except Exception as e:
        if not known_bug(e):
            raise
        err = e
    STATS.setdefault("e2e.load", {"max_seconds": 0.0})
    STATS["e2e.load"]["max_seconds"] = max(STATS["e2e.load"]["max_seconds"], time.perf_counter() - t0)
    same = err is None and _bits(t).keys() == good.keys() and all(torch.equal(_bits(t)[k], good[k]) for k in good)
    codes = {}
    for argv in (["verify", str(d), "-q"], ["inspect", str(d)], ["inspect", str(d), "--json", "--tensors"]):
        out, errout = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errout):
            try:
                rc = unickpt.cli.main(argv)
            except Exception as e:  # a traceback, unless a known bug (then counted as a refusal)
                if not known_bug(e):
                    raise
                rc = 2
        assert "Traceback" not in errout.getvalue()
        assert rc in ((0, 1, 2) if argv[0] == "verify" else (0, 2)), (argv, rc, errout.getvalue()[-500:])
        codes[argv[0]] = rc
    if isinstance(err, ChecksumError):  # damaged tensor bytes: verify must see them too
        assert codes["verify"] != 0
    note(f"load: {type(err).__name__ if err else 'ok'} {str(err)[:200] if err else ''}; same={same}; cli={codes}")
    event(f"load {type(err).__name__ if err else ('ok, same values' if same else 'ok, other values')}; cli {codes}")
    return err, same


@pytest.fixture
def scratch(tmp_path):
    return tmp_path / "ckpt"


def _copy(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


@fuzz(120)
@given(data=st.data(), which=st.sampled_from(["plain", "o1", "plain-v1", "o1-v1"]))
def test_e2e_file_damage(ckpts, scratch, data, which):
    """A flipped byte, a truncation, an extension or a removal of one data file: a typed
    error, or (damage in padding) exactly the original values."""
    src, sd, good = ckpts[which]
    _copy(src, scratch)
    files = sorted(p.name for p in scratch.iterdir() if p.name != "unickpt.json")
    f = scratch / data.draw(st.sampled_from(files))
    blob = f.read_bytes()
    op = data.draw(st.sampled_from(["flip"] * 6 + ["truncate", "append", "remove"]))
    if op == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob = blob[:i] + bytes([blob[i] ^ data.draw(st.integers(1, 255))]) + blob[i + 1 :]
        f.write_bytes(blob)
    elif op == "truncate":
        f.write_bytes(blob[: data.draw(st.integers(0, len(blob) - 1))])
    elif op == "append":
        f.write_bytes(blob + data.draw(st.binary(min_size=1, max_size=64)))
    else:
        f.unlink()
    note(f"{op} {f.name}")
    err, same = _outcome(scratch, sd, good)
    event(f"{op} {f.name.split('-')[0]}: {type(err).__name__ if err else ('same' if same else 'changed')}")
    assert err is not None or same, "damage changed the loaded values without an error"


@fuzz(60)
@given(data=st.data(), which=st.sampled_from(["plain", "o1", "plain-v1", "o1-v1"]))
def test_e2e_manifest_damage_no_crash(ckpts, scratch, data, which):
    """Byte damage of the manifest: typed errors only (load and CLI)."""
    src, sd, good = ckpts[which]
    _copy(src, scratch)
    m = scratch / "unickpt.json"
    m.write_bytes(data.draw(byte_damage(m.read_bytes())))
    _outcome(scratch, sd, good)


@fuzz(40)
@given(data=st.data(), which=st.sampled_from(["plain", "o1"]))
def test_e2e_manifest_damage_detected(ckpts, scratch, data, which):
    src, sd, good = ckpts[which]
    _copy(src, scratch)
    m = scratch / "unickpt.json"
    blob = m.read_bytes()
    bad = data.draw(byte_damage(blob))
    assume(bad != blob)
    m.write_bytes(bad)
    err, same = _outcome(scratch, sd, good)
    assert err is not None or same


@fuzz(150)
@given(data=st.data(), which=st.sampled_from(["plain", "o1"]))
def test_e2e_manifest_forged(ckpts, manifests, scratch, data, which):
    """Structural edits of the manifest, re-sealed (what a buggy writer or a forger produces):
    load and the CLI raise typed errors or succeed; they never crash."""
    src, sd, good = ckpts[which]
    _copy(src, scratch)
    doc = unseal(manifests[which])
    text = seal(emit(doc, (), data.draw(json_edits(doc))).encode())
    (scratch / "unickpt.json").write_bytes(text)
    _outcome(scratch, sd, good)


# == 6. replay of inputs that found bugs ======================================================================


KINDS = ("header", "manifest", "container", "codec")  # tests/attacks/<kind>/ replayed here


def _attack_files():
    if not ATTACKS.is_dir():
        return []
    return sorted(p for kind in KINDS if (ATTACKS / kind).is_dir()
                  for p in (ATTACKS / kind).iterdir() if p.is_file() and p.suffix != ".md" and p.name != "KNOWN.json")


def _payload(p: Path) -> bytes:
    data = p.read_bytes()
    return zstandard.ZstdDecompressor().decompress(data) if p.suffix == ".zst" else data


def replay(p: Path):
    """Feed one attack file to its parser; returns the typed error (None if accepted)."""
    kind = p.relative_to(ATTACKS).parts[0]
    data = _payload(p)
    if kind == "header":  # both entry points must refuse it
        _, e1 = _check_header(data, len(data))
        _, e2 = bounded("format.read_header", len(data), _fmt.read_header, BytesReader(data))
        return e2 if e1 is not None and e2 is not None else None
    if kind == "manifest":
        return _check_manifest(data)[1]
    if kind == "container":
        spec = json.loads(data)
        stored = base64.b64decode(spec["stored_b64"])
        ssize = spec.get("stored_size", len(stored))
        if spec.get("check_frames_rejects"):  # the table alone must be refused
            return bounded("container.check_frames", len(data), _ct.check_frames, spec["frames"], spec["size"], ssize, "x")[1]
        return _check_framed(spec["size"], stored, spec["frames"], spec["size"], ssize,
                             [(0, spec["size"])] if spec["size"] < 1 << 30 else [])[1]
    if kind == "codec":
        spec = json.loads(data)
        tag, shape, lo, hi = spec["tag"], tuple(spec["shape"]), spec["lo"], spec["hi"]
        try:
            _cp.parts_of(tag, shape)
            ranges = _cp.byte_ranges(tag, lo, hi)
            parts = {k: torch.zeros(max(e - b, 0), dtype=torch.uint8) for k, (b, e) in ranges.items()}
            for k, v in spec.get("part_bytes", {}).items():
                parts[k] = torch.zeros(v, dtype=torch.uint8)
            _cp.decode_range(tag, parts, lo, hi, torch.zeros(hi - lo, dtype=torch.bfloat16), None)
        except UnickptError as e:
            return e
        return None
    pytest.fail(f"unknown attack kind {kind!r} ({p})")


def _known(p: Path) -> str | None:
    """Attack files whose bug lives in a module being fixed elsewhere: ``KNOWN.json`` beside
    them maps file names to the reason (replayed as non-strict xfail until fixed)."""
    f = p.parent / "KNOWN.json"
    if not f.exists():
        return None
    return json.loads(f.read_text()).get(p.name)


@pytest.mark.parametrize("path", _attack_files(), ids=lambda p: str(p.relative_to(ATTACKS)))
def test_attack_replay(path):
    reason = _known(path)
    try:
        err = replay(path)
    except Exception:
        if reason:
            pytest.xfail(reason)
        raise
    if reason and (err is None or not isinstance(err, UnickptError)):
        pytest.xfail(reason)
    assert isinstance(err, UnickptError), f"{path}: accepted ({err!r})"
