"""SaveOptions: one checked, frozen set of options for the synchronous save and the
asynchronous writer; the same typed errors either way; progress with async_save."""

import dataclasses
import json
import os

import pytest
import torch

import unickpt
from tests import dist
from unickpt.compress import Compression
from unickpt.errors import DistributedError, InvalidArgumentError, StateDictError
from unickpt.saving import SaveOptions

# bad keyword -> the typed error unickpt.save raises for it, with or without async_save

def _deep(n):
    v = 0
    for _ in range(n):
        v = [v]
    return v

BAD = {
    "step-str": (dict(step="3"), StateDictError),
    "step-bool": (dict(step=True), StateDictError),
    "extra-not-json": (dict(extra={"lr": object()}), StateDictError),
    "extra-nan": (dict(extra={"lr": float("nan")}), StateDictError),
    "strategy-not-json": (dict(strategy={"tp": {1, 2}}), StateDictError),
    "extra-file-path": (dict(extra_files={"../config.json": "{}"}), StateDictError),
    "extra-file-manifest": (dict(extra_files={"unickpt.json": "{}"}), StateDictError),
    "extra-file-bytes": (dict(extra_files={"config.json": b"{}"}), StateDictError),
    "bucket-small": (dict(bucket_bytes=1024), InvalidArgumentError),
    "bucket-float": (dict(bucket_bytes=1e6), InvalidArgumentError),
    "max-file-zero": (dict(max_file_bytes=0), InvalidArgumentError),
    "quant": (dict(quant="O3"), InvalidArgumentError),
    "master": (dict(master="half"), InvalidArgumentError),
    "zstd": (dict(zstd=99), InvalidArgumentError),
    "compression-str": (dict(compression="O1"), InvalidArgumentError),
    "compression-and-quant": (dict(compression=Compression(quant="O1"), quant="O2"), InvalidArgumentError),
    "overwrite": (dict(overwrite="yes"), InvalidArgumentError),
    "direct-io": (dict(direct_io=1), InvalidArgumentError),
    "timeout": (dict(timeout_s=-1), InvalidArgumentError),
    "storage-options": (dict(storage_options={"client": object()}), InvalidArgumentError),
    "storage-options-deep": (dict(storage_options={"a": _deep(150)}), InvalidArgumentError),
}


def _bad_inputs(rank, world, root):
    from unickpt.async_save import checkpointer

    sd = {"model": {"w": unickpt.shard(torch.ones(4, 8), (8, 8), offsets=(4 * rank, 0))}}
    out = {}
    for name, (kw, _) in BAD.items():
        got = []
        for asy in (False, True):
            try:
                h = unickpt.save(sd, os.path.join(root, name), async_save=asy, **kw)
            except Exception as e:  # raised by the call itself, not by a later wait()
                got.append(type(e).__name__)
            else:
                if asy:
                    h.wait(timeout=120)
                got.append(None)
        out[name] = got
    c = checkpointer()
    return out, c._seg is None and c._proc is None  # nothing staged, no writer started


def test_the_same_bad_input_raises_the_same_typed_error_sync_and_async(tmp_path):
    root = str(tmp_path)
    for out, untouched in dist.run(_bad_inputs, 2, root, timeout=300):
        assert untouched
        for name, (_, cls) in BAD.items():
            assert out[name] == [cls.__name__] * 2, (name, out[name])
    assert os.listdir(root) == []  # nothing created, not even a temporary


def _one_rank_bad(rank, world, root):
    sd = {"model": {"w": unickpt.shard(torch.ones(4, 8), (8, 8), offsets=(4 * rank, 0))}}
    out = []
    for asy in (False, True):
        try:  # only rank 1's extra is bad: rank 0 must not wait for it in a later collective
            unickpt.save(sd, os.path.join(root, f"ck-{asy}"), async_save=asy, timeout_s=60,
                         extra={"pos": object() if rank == 1 else 3})
        except (StateDictError, DistributedError) as e:
            out.append((type(e).__name__, str(e)))
    # and the ranks are still in step: a good save right after works on both
    unickpt.save(sd, os.path.join(root, "good"), async_save=True).wait(timeout=120)
    return out


def test_options_bad_on_one_rank_fail_every_rank_at_once(tmp_path):
    root = str(tmp_path)
    out = dist.run(_one_rank_bad, 2, root, timeout=300)
    for name, msg in out[1]:
        assert name == "StateDictError" and "extra" in msg
    for name, msg in out[0]:
        assert name == "DistributedError" and "rank 1" in msg and "extra" in msg, msg
    assert len(out[0]) == len(out[1]) == 2
    assert sorted(os.listdir(root)) == ["good"]


def test_save_options_are_frozen_checked_private_copies_and_travel_as_json():
    extra = {"sched": {"lr": [1e-3, 2e-3]}, "pos": (1, 2)}
    opts = SaveOptions.of(step=3, extra=extra, quant="O1", zstd=3, extra_files={"config.json": "{}"},
                          storage_options={"key": "SECRET-KEY", "client_kwargs": {"region_name": "x"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.step = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.compression = None
    extra["sched"]["lr"].append(1.0)  # the caller's dict changes after the call
    assert opts.extra == {"sched": {"lr": [1e-3, 2e-3]}, "pos": [1, 2]}
    assert "SECRET-KEY" not in repr(opts)
    wire = json.loads(json.dumps(opts.to_json(), allow_nan=False))
    back = SaveOptions.from_json(wire)
    assert back == opts and back.compression == Compression(quant="O1", zstd=3)
    assert back.storage_options == {"key": "SECRET-KEY", "client_kwargs": {"region_name": "x"}}
    # an inactive compression is no compression; from_json checks again
    assert SaveOptions(compression=Compression()).compression is None
    with pytest.raises(StateDictError):
        SaveOptions.from_json({**wire, "step": "3"})
    with pytest.raises(InvalidArgumentError):
        SaveOptions.from_json({**wire, "compression": {"quant": "O3"}})
    with pytest.raises(InvalidArgumentError):
        SaveOptions.from_json({**wire, "surprise": 1})


def test_saving_does_not_import_async_save():
    import ast
    import pathlib

    import unickpt.saving as saving

    names = set()
    for node in (n for p in pathlib.Path(saving.__file__).parent.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))):
        if isinstance(node, ast.ImportFrom):
            names.add((node.module or "") + ":" + ",".join(a.name for a in node.names))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    assert not [n for n in names if "async_save" in n or n.startswith("api") or ":api" in n], names


def test_writer_path_keeps_urls(tmp_path, monkeypatch, aws_offline):
    from unickpt.async_save import writer_path

    monkeypatch.chdir(tmp_path)
    assert writer_path("s3://bucket/ckpt/step-1") == "s3://bucket/ckpt/step-1"
    assert writer_path("memory://x") == "memory://x"
    assert writer_path("ckpt/{node}/a") == os.path.join(str(tmp_path), "ckpt/{node}/a")


def _state(rank, world):
    g = torch.Generator().manual_seed(rank)
    rows = 256
    return {
        "model": {"w": unickpt.shard(torch.ones(rows, 64), (rows * world, 64), offsets=(rows * rank, 0))},
        # zstd: optimizer tensors are gathered by their writer in buckets, step by step
        "optimizer": {f"m{i}": unickpt.shard(torch.randn(rows, 1024, generator=g), (rows * world, 1024),
                                             offsets=(rows * rank, 0)) for i in range(24)},
    }


def _progress(rank, world, root):
    sync, asy, calls = [], [], []
    unickpt.save(_state(rank, world), os.path.join(root, "sync"), zstd=1, bucket_bytes=1 << 20,
                 progress=lambda d, t: sync.append((d, t)))
    h = unickpt.save(_state(rank, world), os.path.join(root, "async"), zstd=1, bucket_bytes=1 << 20,
                     async_save=True, progress=lambda d, t: asy.append((d, t)))
    h.wait(timeout=120)

    def bad(d, t):
        calls.append((d, t))
        raise RuntimeError("callback bug")

    h = unickpt.save(_state(rank, world), os.path.join(root, "async-bad"), zstd=1, bucket_bytes=1 << 20,
                     async_save=True, progress=bad)
    res = h.wait(timeout=120)
    return sync, asy, calls, res.path


def test_progress_with_async_save_increases_to_the_total(tmp_path):
    root = str(tmp_path)
    for sync, asy, calls, path in dist.run(_progress, 2, root, timeout=300):
        assert sync and asy
        total = sync[-1][1]
        assert sync[-1] == (total, total) and total > 0
        assert asy[-1] == (total, total)  # the same plan: the same bytes to write
        assert all(t == total for _, t in asy)
        done = [d for d, _ in asy]
        assert len(done) >= 2 and done == sorted(set(done)), asy  # strictly increasing, several reports
        assert len(calls) == 1  # a failing callback is called once, and the save still commits
        assert path.endswith("async-bad")
    assert unickpt.read_manifest(os.path.join(root, "async-bad"))[1].step is None
