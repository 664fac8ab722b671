"""Single-process save/load: round trips, JSON state, commit rules and bad input."""

import json
import os
import struct

import pytest
import torch

import unickpt
from tests.crafted import seal, seal_text
from unickpt.errors import (
    ChecksumError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DtypeMismatchError,
    FormatError,
    ShapeMismatchError,
    StateDictError,
    TensorMissingError,
    UnickptError,
)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "model.embed_tokens.weight": torch.randn(50, 16, generator=g).bfloat16(),
            "model.norm.weight": torch.randn(16, generator=g),
            "lm_head.weight": torch.randn(50, 16, generator=g).half(),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
            "mask": torch.rand(9, generator=g) > 0.5,
            "ids": torch.arange(7, dtype=torch.int32),
        },
        "optimizer": {"exp_avg": {"lm_head.weight": torch.randn(50, 16, generator=g)}, "param_groups": [{"lr": 0.1, "betas": [0.9, 0.95]}]},
        "step": 12,
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
    }


def _zeros(sd):
    if isinstance(sd, dict):
        return {k: _zeros(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeros(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None if not isinstance(sd, (int, float)) else type(sd)(0)


def _eq(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_round_trip_all_dtypes_and_json_state(tmp_path):
    sd = _state()
    res = unickpt.save(sd, tmp_path / "step-00000012", step=12, extra={"data": {"epoch": 1, "offset": 77}})
    assert res.bytes == sum(os.path.getsize(tmp_path / "step-00000012" / f) for f in res.files)
    tgt = _zeros(sd)
    out = unickpt.load(tgt, tmp_path)  # a root: newest committed step
    assert _eq(tgt, sd)
    assert out.step == 12 and out.extra == {"data": {"epoch": 1, "offset": 77}}
    assert out.tensors == 9 and out.verified == 8  # every non-empty tensor read whole was checked


def test_layout_of_files_and_hf_index(tmp_path):
    sd = _state()
    p = tmp_path / "ck"
    unickpt.save(sd, p)
    names = sorted(os.listdir(p))
    assert names == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "optimizer-00001-of-00001.safetensors",
        "other-00001-of-00001.safetensors",
        "unickpt.json",
    ]
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(sd["model"])
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd["model"].values())
    from safetensors.torch import load_file

    flat = load_file(str(p / "model-00001-of-00001.safetensors"))
    for k, v in sd["model"].items():
        assert torch.equal(flat[k], v)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left


def test_existing_checkpoint_is_never_replaced_silently(tmp_path):
    p = tmp_path / "ck"
    unickpt.save({"model": {"w": torch.ones(3)}}, p)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        unickpt.save({"model": {"w": torch.zeros(3)}}, p)
    t = {"model": {"w": torch.empty(3)}}
    unickpt.load(t, p)
    assert torch.equal(t["model"]["w"], torch.ones(3))
    unickpt.save({"model": {"w": torch.full((3,), 2.0)}}, p, overwrite=True)
    unickpt.load(t, p)
    assert torch.equal(t["model"]["w"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def _dead_owner(tmp_dir) -> None:
    """Owner record of a process that has exited, as an interrupted save leaves it."""
    import json
    import socket
    import subprocess

    import psutil

    p = subprocess.Popen(["true"])
    started = psutil.Process(p.pid).create_time()
    p.wait()
    (tmp_dir / ".owner").write_text(json.dumps({"host": socket.gethostname(), "pid": p.pid, "started": started}))


def test_uncommitted_checkpoints_are_invisible_and_swept(tmp_path):
    unickpt.save({"model": {"w": torch.ones(3)}}, tmp_path / "step-00000001", step=1)
    # an interrupted save: data present, no manifest, temporary name, its owner gone
    (tmp_path / ".step-00000002.tmp-0123456789abcdef").mkdir()
    _dead_owner(tmp_path / ".step-00000002.tmp-0123456789abcdef")
    (tmp_path / ".step-00000002.tmp-0123456789abcdef" / "model-00001-of-00001.safetensors").write_bytes(b"x" * 10)
    # a final-looking directory without manifest is not a checkpoint either
    (tmp_path / "step-00000003").mkdir()
    assert unickpt.latest(tmp_path).endswith("step-00000001")
    t = {"model": {"w": torch.empty(3)}}
    assert unickpt.load(t, tmp_path).step == 1
    with pytest.raises(CheckpointNotFoundError):
        unickpt.load(t, tmp_path / "step-00000003")
    unickpt.save({"model": {"w": torch.ones(3)}}, tmp_path / "step-00000002", step=2)
    assert not (tmp_path / ".step-00000002.tmp-0123456789abcdef").exists()
    assert unickpt.latest(tmp_path).endswith("step-00000002")


def test_missing_path():
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        unickpt.load({"model": {"w": torch.empty(1)}}, "/nonexistent/unickpt/ck")


@pytest.fixture
def saved(tmp_path):
    sd = {"model": {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}}
    p = tmp_path / "ck"
    unickpt.save(sd, p)
    return p, sd


def test_missing_tensor_names_file_and_tensor_and_fills_nothing(saved):
    p, sd = saved
    t = {"model": {"a": torch.zeros(3, 4), "c": torch.zeros(2)}}
    with pytest.raises(TensorMissingError, match="tensor 'c' \\(role model\\) is not in the checkpoint"):
        unickpt.load(t, p)
    assert torch.count_nonzero(t["model"]["a"]) == 0  # validated before any read
    res = unickpt.load(t, p, strict=False)
    assert res.missing == ["model/c"] and torch.equal(t["model"]["a"], sd["model"]["a"])


def test_shape_and_dtype_mismatch(saved):
    p, _ = saved
    with pytest.raises(ShapeMismatchError, match=r"model-00001-of-00001.safetensors: tensor 'a' .* shape \[3, 4\].* \[4, 3\]"):
        unickpt.load({"model": {"a": torch.zeros(4, 3)}}, p)
    with pytest.raises(DtypeMismatchError, match=r"tensor 'b' .* stored as BF16, the target is F32"):
        unickpt.load({"model": {"b": torch.zeros(5)}}, p)


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupted_byte_is_detected_naming_tensor_and_file(saved):
    p, _ = saved
    _, man = unickpt.read_manifest(p)
    a = man.tensors[("model", "a")]
    f = p / a.file
    _flip_byte(f, man.files[a.file].data_start + a.begin + 5)
    with pytest.raises(ChecksumError, match=r"tensor 'a' in model-00001-of-00001.safetensors") as ei:
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)
    assert ei.value.bad == [(a.file, "a")]
    # 'b' is intact and still loads; verify="none" skips checks
    unickpt.load({"model": {"b": torch.zeros(5, dtype=torch.bfloat16)}}, p, strict=False)
    unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, verify="none", strict=False)


def test_verify_full_checks_tensors_not_read(saved):
    p, _ = saved
    _, man = unickpt.read_manifest(p)
    b = man.tensors[("model", "b")]
    _flip_byte(p / b.file, man.files[b.file].data_start + b.begin)
    unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)  # auto: 'b' not read
    with pytest.raises(ChecksumError, match="tensor 'b'"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, verify="full", strict=False)


def test_truncated_file_and_hostile_manifest(saved, tmp_path):
    p, _ = saved
    f = p / "model-00001-of-00001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-3])
    with pytest.raises(FormatError, match="manifest records"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)
    f.write_bytes(data)
    man = json.loads((p / "unickpt.json").read_text())
    bad = json.loads(json.dumps(man))
    first = next(iter(bad["files"]))
    bad["files"]["../../etc/passwd"] = bad["files"].pop(first)
    (p / "unickpt.json").write_bytes(seal(bad))
    with pytest.raises(FormatError, match="not a valid checkpoint file name"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)
    bad = json.loads(json.dumps(man))
    bad["format_version"] = 99
    (p / "unickpt.json").write_bytes(seal(bad))
    with pytest.raises(FormatError, match="format_version 99"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)
    bad = json.loads(json.dumps(man))
    bad["tensors"]["model"]["a"]["offsets"] = [0, 10**12]
    (p / "unickpt.json").write_bytes(seal(bad))
    with pytest.raises(FormatError, match="tensor 'a'"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)
    (p / "unickpt.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)


def test_hostile_safetensors_header(saved):
    p, _ = saved
    f = p / "model-00001-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    f.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="header does not match its checksum"):  # damage is caught first
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)
    # an attacker rewrites the header checksum too: the parser still refuses the header
    import xxhash

    man = json.loads((p / "unickpt.json").read_bytes())
    fe = man["files"]["model-00001-of-00001.safetensors"]
    fe["header_xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data[: fe["data_start"]]))
    (p / "unickpt.json").write_bytes(seal(man))
    with pytest.raises(FormatError, match="header length"):
        unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)


def test_unsupported_values_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(StateDictError, match="'model.fn' holds a function"):
        unickpt.save({"model": {"fn": lambda: 0}}, tmp_path / "ck")
    with pytest.raises(StateDictError, match="role"):
        unickpt.save({"Model": {"w": torch.ones(1)}}, tmp_path / "ck")
    with pytest.raises(StateDictError, match="both map to tensor 'a.b'"):
        unickpt.save({"model": {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}}, tmp_path / "ck")
    with pytest.raises(StateDictError, match="'x' holds a set"):  # (NaN and infinities are stored: test_semantics)
        unickpt.save({"model": {"w": torch.ones(1)}, "x": {1, 2}}, tmp_path / "ck")
    assert not os.listdir(tmp_path)


def test_non_contiguous_and_view_targets(tmp_path):
    w = torch.arange(24.0).reshape(4, 6)
    unickpt.save({"model": {"w": w.t()}}, tmp_path / "ck")  # non-contiguous source
    t = torch.zeros(6, 4)
    unickpt.load({"model": {"w": t}}, tmp_path / "ck")
    assert torch.equal(t, w.t())
    buf = torch.zeros(30)
    view = buf[3:27].view(6, 4)
    unickpt.load({"model": {"w": view}}, tmp_path / "ck")
    assert torch.equal(view, w.t()) and buf[:3].eq(0).all() and buf[27:].eq(0).all()
    nc = torch.zeros(4, 6).t()
    unickpt.load({"model": {"w": nc}}, tmp_path / "ck")
    assert torch.equal(nc, w.t())


def test_errors_share_one_base_class():
    for name in unickpt.errors.__all__:
        assert issubclass(getattr(unickpt.errors, name), UnickptError)


def test_reserved_names_bad_step_and_extra_files_are_refused(tmp_path):
    with pytest.raises(StateDictError, match="reserved"):
        unickpt.save({"model": {"__metadata__": torch.ones(1)}}, tmp_path / "a")
    with pytest.raises(StateDictError, match="step must be an int"):
        unickpt.save({"model": {"w": torch.ones(1)}}, tmp_path / "a", step=1.0)
    with pytest.raises(StateDictError, match="extra file"):
        unickpt.save({"model": {"w": torch.ones(1)}}, tmp_path / "a", extra_files={"model-00001-of-00001.safetensors": "x"})
    with pytest.raises(StateDictError, match="extra file"):
        unickpt.save({"model": {"w": torch.ones(1)}}, tmp_path / "a", extra_files={"../x.json": "x"})
    unickpt.save({"model": {"w": torch.ones(1)}}, tmp_path / "a", extra_files={"config.json": "{}"})
    assert (tmp_path / "a" / "config.json").read_text() == "{}"


def test_manifest_parser_turns_every_oddity_into_format_errors(saved):
    p, _ = saved
    good = (p / "unickpt.json").read_text()
    for bad in (
        good.replace('"step":null', '"step":NaN'),
        good.replace('"state":{}', '"state":{"x":' + "9" * 5000 + "}"),
        good.replace('"state":{}', '"state":' + "[" * 100000 + "]" * 100000),
        good.replace('"writer":0', '"writer":"abc"', 1),
    ):
        assert bad != good
        (p / "unickpt.json").write_bytes(seal_text(bad))
        with pytest.raises(FormatError):
            unickpt.load({"model": {"a": torch.zeros(3, 4)}}, p, strict=False)


def test_sweep_removes_only_temporaries(tmp_path):
    unickpt.save({"model": {"w": torch.ones(3)}}, tmp_path / "step-00000001", step=1)
    (tmp_path / ".step-00000002.tmp-0123456789abcdef").mkdir()
    _dead_owner(tmp_path / ".step-00000002.tmp-0123456789abcdef")
    (tmp_path / ".step-00000001.old-0123456789abcdef").mkdir()
    (tmp_path / "notes").mkdir()
    removed = unickpt.sweep(tmp_path)
    assert len(removed) == 2
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-00000001"]


def test_sweep_keeps_temporaries_of_live_or_unknown_owners_until_stale(tmp_path):
    import json
    import socket
    import time

    import psutil

    live = tmp_path / ".step-00000005.tmp-00000000000000aa"
    live.mkdir()
    me = psutil.Process()
    (live / ".owner").write_text(json.dumps({"host": socket.gethostname(), "pid": me.pid, "started": me.create_time()}))
    unknown = tmp_path / ".step-00000006.tmp-00000000000000bb"  # no owner record (or another host)
    unknown.mkdir()
    (unknown / "model-00001-of-00001.safetensors").write_bytes(b"x")
    assert unickpt.sweep(tmp_path) == []
    old = time.time() - 7 * 3600
    for p in (unknown, unknown / "model-00001-of-00001.safetensors"):
        os.utime(p, (old, old))
    assert unickpt.sweep(tmp_path) == [str(unknown)]
    assert live.exists()


def test_a_temporary_whose_writer_outlives_its_trainer_is_swept_at_once(tmp_path):
    """An asynchronous writer's owner record names its trainer too: once the trainer is gone
    the write is dead, whether or not the writer's watchdog has noticed yet (a resumed job's
    sweep must not race that watchdog)."""
    import json
    import socket
    import subprocess
    import sys

    import psutil

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = psutil.Process()
    writer = {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time()}
    orphan = tmp_path / ".step-00000005.tmp-00000000000000aa"
    kept = tmp_path / ".step-00000006.tmp-00000000000000bb"
    odd = tmp_path / ".step-00000007.tmp-00000000000000cc"
    for d, principal in ((orphan, {"pid": dead.pid, "started": None}),
                         (kept, {"pid": me.pid, "started": me.create_time()}),
                         (odd, "not a record")):  # (a "for" that does not parse: the writer decides)
        d.mkdir()
        (d / ".owner").write_text(json.dumps({**writer, "for": principal}))
    assert unickpt.sweep(tmp_path) == [str(orphan)]
    assert kept.exists() and odd.exists()


def test_owner_records_of_a_writer_name_its_trainer(monkeypatch):
    from unickpt import liveness

    monkeypatch.setattr(liveness, "_PRINCIPAL", None)
    assert "for" not in liveness.me()
    liveness.act_for(os.getppid(), liveness.start_time(os.getppid()))
    rec = liveness.me()
    assert rec["for"]["pid"] == os.getppid() and rec["pid"] == os.getpid()
    assert liveness.record_alive(rec, 0.0, 0.0, grace=1, stale=1)


def test_a_master_policy_that_applies_to_nothing_warns_and_is_not_recorded(tmp_path):
    """master='residual' with the masters under another key (not the role 'master') cannot
    apply: said at once, and the manifest records what was applied (master full), so
    `unickpt inspect` does not claim residual masters."""
    import json
    import warnings

    w = torch.randn(8, 8)
    opts = unickpt.SaveOptions(compression=unickpt.Compression(master="residual"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        unickpt.save({"model": {"w": w.bfloat16()}, "masters": {"w": w}}, tmp_path / "a", options=opts)
    assert any("applies to no tensor" in str(x.message) and "'master'" in str(x.message) for x in seen)
    assert json.loads((tmp_path / "a" / "unickpt.json").read_text())["compression"].get("master", "full") == "full"
    unickpt.save({"model": {"w": w.bfloat16()}, "master": {"w": w}}, tmp_path / "b", options=opts)
    assert json.loads((tmp_path / "b" / "unickpt.json").read_text())["compression"]["master"] == "residual"


def test_hostile_compressed_manifests_are_refused(tmp_path):
    """Codec arguments, parts, residual exceptions and zstd frames are validated before a byte
    of tensor data is read; a frame that does not decompress is a FormatError."""
    w = torch.randn(40, 20)
    sd = {"model": {"w": w.bfloat16()}, "master": {"w": w},
          "optimizer": {"exp_avg": {"w": torch.randn(40, 20)}, "exp_avg_sq": {"w": torch.rand(40, 20)}}}
    p = tmp_path / "ck"
    unickpt.save(sd, p, quant="O2", master="residual", zstd=3)

    def target():
        return {"master": {"w": torch.zeros(40, 20)},
                "optimizer": {"exp_avg": {"w": torch.zeros(40, 20)}, "exp_avg_sq": {"w": torch.zeros(40, 20)}}}

    unickpt.load(target(), p)
    good = json.loads((p / "unickpt.json").read_text())
    opt = next(n for n, f in good["files"].items() if f["role"] == "optimizer")

    def mutate(fn):
        bad = json.loads(json.dumps(good))
        fn(bad)
        return bad

    cases = [
        (lambda m: m["tensors"]["optimizer"]["exp_avg.w"].__setitem__("codec", "q3_magic"), "unknown codec"),
        (lambda m: m["tensors"]["optimizer"]["exp_avg.w"]["codec_args"].__setitem__("group", 7), "even"),
        (lambda m: m["tensors"]["optimizer"]["exp_avg.w"]["codec_args"].__setitem__("group", 1 << 40), "even"),
        (lambda m: m["files"][opt]["frames"].append(list(m["files"][opt]["frames"][-1])), "frame"),
        (lambda m: m["tensors"]["optimizer"]["exp_avg_sq.w"]["codec_args"].__setitem__("eps", -1.0), "eps"),
        (lambda m: m["tensors"]["optimizer"]["exp_avg.w"]["parts"].pop("scales"), "parts"),
        (lambda m: m["tensors"]["optimizer"]["exp_avg.w"]["parts"]["codes"].__setitem__("shape", [10**9]), "needs"),
        (lambda m: m["tensors"]["master"]["w"]["codec_args"].__setitem__("exceptions", [[10**6], [1]]), "exceptions"),
        (lambda m: m["tensors"]["master"]["w"]["codec_args"].__setitem__("model", "nope"), "same shape"),
        (lambda m: m["files"][opt]["frames"][0].__setitem__(1, 10**12), "frame"),
        (lambda m: m["files"][opt].__setitem__("container", "rar"), "unknown container"),
        (lambda m: m["files"][opt].__setitem__("stored_size", 10), "frame"),
    ]
    for fn, msg in cases:
        (p / "unickpt.json").write_bytes(seal(mutate(fn)))
        with pytest.raises(FormatError, match=msg):
            unickpt.load(target(), p)
    (p / "unickpt.json").write_bytes(seal(good))
    f = p / opt
    data = bytearray(f.read_bytes())
    z = next(fr for fr in good["files"][opt]["frames"] if fr[4])
    data[z[2] + z[3] // 2] ^= 0xFF  # inside a compressed frame
    f.write_bytes(bytes(data))
    with pytest.raises((FormatError, ChecksumError)):
        unickpt.load(target(), p)


def test_zstd_frames_are_bounded_by_the_stored_file():
    """Frames may not share stored bytes (a tiny file could otherwise claim a huge logical
    size), and a frame never decompresses past its declared length."""
    import zstandard

    from unickpt.container import ZstdReader, check_frames

    with pytest.raises(FormatError, match="overlap"):
        check_frames([[0, 10, 0, 10, 0], [10, 20, 0, 10, 0]], 20, 10, "f")
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # 64 MiB of zeros, a few KiB stored

    class Inner:
        path, size, bytes_read = "f", len(bomb), 0

        def readinto(self, off, out):
            out[:] = bomb[off : off + len(out)]

        def close(self):
            pass

    r = ZstdReader(Inner(), [[0, 4096, 0, len(bomb), 1]], 4096, len(bomb))
    with pytest.raises(FormatError, match="expected 4096"):
        r.readinto(0, memoryview(bytearray(16)))
