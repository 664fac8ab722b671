"""Trust findings of issue #10, each tried as an attacker or an unlucky operator would: every
byte a load returns is verified in every layout, nothing outside the checkpoint is read,
the manifest protects itself, concurrent saves never lose a checkpoint, hostile inputs get
typed errors in bounded time and memory."""

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

import unickpt
from tests.clirun import cli
from tests.crafted import seal
from unickpt.errors import (
    CheckpointChangedError,
    CheckpointExistsError,
    ChecksumError,
    FormatError,
    InvalidArgumentError,
    LayoutError,
    StateDictError,
    UnickptError,
)
from unickpt.format import CHECK_BLOCK
from unickpt.manifest import Manifest

H = 512  # a 512 x 512 fp32 tensor is exactly one checksum block (1 MiB)


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "layers.0.self_attn.o_proj.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
            "big": torch.randn(4 * H, H, generator=g),  # 4 blocks
            "norm": torch.ones(32),
        },
        "step": 3,
    }


@pytest.fixture
def ck(tmp_path):
    p = tmp_path / "ck"
    unickpt.save(_state(), p, step=3, extra={"lr": 0.001}, extra_files={"config.json": json.dumps({"hidden_size": 32})})
    return p


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _flip_tensor(p, name, byte, role="model"):
    _, man = unickpt.read_manifest(p)
    t = man.tensors[(role, name)]
    _flip(p / t.file, man.files[t.file].data_start + t.begin + byte)


# -- finding 3: every byte a load returns is verified, in every layout ------------------------


@pytest.mark.parametrize("layout", ["rows", "columns", "flat"])
def test_a_bit_flip_next_to_a_slice_is_caught_in_every_layout(ck, layout):
    name = "layers.0.self_attn.o_proj.weight"  # 32 x 64 bf16: one checksum block
    _flip_tensor(ck, name, 40 * 2 + 1)  # row 0, column 40: outside every slice below
    if layout == "rows":
        t = unickpt.shard(torch.zeros(16, 64, dtype=torch.bfloat16), (32, 64), offsets=(16, 0))
    elif layout == "columns":
        t = unickpt.shard(torch.zeros(32, 32, dtype=torch.bfloat16), (32, 64), offsets=(0, 0))
    else:
        t = unickpt.shard(torch.zeros(100, dtype=torch.bfloat16), (32, 64), flat=(1000, 1100))
    with pytest.raises(ChecksumError, match=name):
        unickpt.load({"model": {name: t}}, ck, group="local", strict=False)
    if layout == "columns":  # the slice that holds the flipped bit fails as well, of course
        t2 = unickpt.shard(torch.zeros(32, 32, dtype=torch.bfloat16), (32, 64), offsets=(0, 32))
        with pytest.raises(ChecksumError):
            unickpt.load({"model": {name: t2}}, ck, group="local", strict=False)


def test_only_the_blocks_a_slice_touches_are_read_and_verified(ck):
    _flip_tensor(ck, "big", 3 * CHECK_BLOCK + 5)  # block 3 of 4
    head = unickpt.shard(torch.zeros(H + 7, H), (4 * H, H), offsets=(0, 0))  # blocks 0-1
    res = unickpt.load({"model": {"big": head}}, ck, group="local", strict=False)
    assert res.verified == 2 and torch.equal(head.local, _state()["model"]["big"][: H + 7])
    tail = unickpt.shard(torch.zeros(3, H), (4 * H, H), offsets=(3 * H + 100, 0))
    with pytest.raises(ChecksumError, match="'big'"):
        unickpt.load({"model": {"big": tail}}, ck, group="local", strict=False)


def test_inference_tp_slices_export_and_reshard_verify_what_they_read(ck, tmp_path):
    _flip_tensor(ck, "layers.0.self_attn.q_proj.weight", 2)  # row 0: tp_rank 1 reads rows 32..63
    with pytest.raises(ChecksumError):
        unickpt.load_for_inference(ck, tp_rank=1, tp_size=2)
    from unickpt.export import export_hf
    from unickpt.offline import reshard_offline

    with pytest.raises(ChecksumError):
        export_hf(ck, tmp_path / "hf")
    with pytest.raises(ChecksumError):
        reshard_offline(ck, tmp_path / "re")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "re").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


# -- finding 4: the manifest, headers, index and config are protected -------------------------


def test_every_single_bit_flip_in_the_manifest_is_refused(ck):
    good = (ck / "unickpt.json").read_bytes()
    for i in range(len(good)):
        for bit in (0, 5):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            with pytest.raises(FormatError):
                Manifest.from_json(bytes(bad), "m")


def test_verify_covers_headers_index_and_config(ck, tmp_path):
    assert cli("verify", ck, "-q").returncode == 0
    _, man = unickpt.read_manifest(ck)
    f = next(n for n in man.files if n.startswith("model"))
    for target, off in ((ck / f, man.files[f].data_start - 3), (ck / "model.safetensors.index.json", 10),
                        (ck / "config.json", 3)):
        orig = target.read_bytes()
        _flip(target, off)
        r = cli("verify", ck, "-q")
        assert r.returncode == 1 and target.name in r.stderr, (target, r.stderr)
        target.write_bytes(orig)
    from unickpt.export import export_hf

    _flip(ck / "config.json", 3)
    with pytest.raises(ChecksumError, match="config.json"):
        export_hf(ck, tmp_path / "hf")


def test_residual_exceptions_must_be_increasing(tmp_path):
    w = torch.randn(8, 8).to(torch.bfloat16)
    p = tmp_path / "r"
    unickpt.save({"model": {"w": w}, "master": {"w": w.float()}}, p, master="residual")
    man = json.loads((p / "unickpt.json").read_bytes())
    args = man["tensors"]["master"]["w"]["codec_args"]
    args["exceptions"] = [[3, 3], [0, 0]]  # one element patched twice
    (p / "unickpt.json").write_bytes(seal(man))
    with pytest.raises(FormatError, match="increasing"):
        unickpt.read_manifest(p)


# -- finding 1 and 8: nothing outside the checkpoint, no hangs ------------------------------


def test_symlinks_out_of_the_checkpoint_are_refused_without_echoing_bytes(ck, tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("SECRET-TOKEN " * 100)
    (ck / "config.json").unlink()
    os.symlink(secret, ck / "config.json")
    r = cli("export", ck, tmp_path / "hf", "-q")
    assert r.returncode == 2 and "symbolic link" in r.stderr and "SECRET" not in r.stderr + r.stdout
    assert not (tmp_path / "hf").exists()
    _, man = unickpt.read_manifest(ck)
    f = next(n for n in man.files if n.startswith("model"))
    os.rename(ck / f, tmp_path / "moved")
    os.symlink(tmp_path / "moved", ck / f)
    with pytest.raises(FormatError, match="symbolic link"):
        unickpt.load({"model": {"norm": torch.zeros(32)}}, ck, group="local", strict=False)
    r = cli("verify", ck, "-q")
    assert r.returncode == 1 and "SECRET" not in r.stderr


@pytest.mark.parametrize("which", ["manifest", "data", "config"])
def test_a_fifo_anywhere_never_blocks(ck, tmp_path, which):
    _, man = unickpt.read_manifest(ck)
    name = {"manifest": "unickpt.json", "data": next(iter(man.files)), "config": "config.json"}[which]
    (ck / name).unlink()
    os.mkfifo(ck / name)
    for cmd in (["inspect", ck], ["verify", ck, "-q"], ["export", ck, tmp_path / "hf", "-q"]):
        r = cli(*cmd, timeout=60)  # a hang fails the test (clirun.CliHung)
        if which == "manifest" or cmd[0] != "inspect":
            assert r.returncode in (1, 2) and "FIFO" in r.stderr + r.stdout, (cmd, r.stderr)


def test_manifest_memory_and_size_bombs_are_refused(ck, tmp_path):
    man = json.loads((ck / "unickpt.json").read_bytes())
    man["extra"] = {"x": [{}] * 300_000}  # beyond the allowance, and 26x its size in memory once parsed
    (ck / "unickpt.json").write_bytes(seal(man))
    with pytest.raises(FormatError, match="objects/arrays"):
        unickpt.read_manifest(ck)
    man["extra"] = {"x": "a" * (40 << 20)}  # far more than a 4 MB checkpoint can need
    (ck / "unickpt.json").write_bytes(seal(man))
    with pytest.raises(FormatError, match="larger than"):
        unickpt.read_manifest(ck)


def test_claims_are_checked_against_the_files_before_allocating_or_creating(ck, tmp_path):
    man = json.loads((ck / "unickpt.json").read_bytes())
    t = man["tensors"]["model"]["norm"]
    t["dtype"], t["shape"] = "U8", [1 << 47]
    t["offsets"] = [t["offsets"][0], t["offsets"][0] + (1 << 47)]
    t["checksums"] = [[0, 1 << 47, "0" * 16]]
    fe = man["files"][t["file"]]
    fe["size"] = fe["data_start"] + (1 << 48)
    (ck / "unickpt.json").write_bytes(seal(man))
    with pytest.raises(FormatError, match="bytes on disk"):
        unickpt.load_for_inference(ck, keys=["norm"])
    from unickpt.export import export_hf
    from unickpt.offline import reshard_offline

    with pytest.raises(FormatError, match="bytes on disk"):
        export_hf(ck, tmp_path / "hf")
    with pytest.raises(FormatError, match="bytes on disk"):
        reshard_offline(ck, tmp_path / "re")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- finding 7: reserved names ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["w::codes", "w::low16", "a\x1b[2Jb", ""])
def test_names_that_collide_with_internal_keys_are_refused_before_writing(tmp_path, name):
    with pytest.raises(StateDictError):
        unickpt.save({"model": {name: torch.ones(2), "ok": torch.ones(2)}}, tmp_path / "ck")
    assert os.listdir(tmp_path) == []


# -- finding 9: typed errors -------------------------------------------------------------------


def test_odd_files_and_values_get_typed_errors(ck, tmp_path):
    (ck / "unickpt.json").rename(tmp_path / "m.json")
    (ck / "unickpt.json").mkdir()
    with pytest.raises(FormatError, match="directory"):
        unickpt.read_manifest(ck)
    (ck / "unickpt.json").rmdir()
    (tmp_path / "m.json").rename(ck / "unickpt.json")
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(UnickptError):
        unickpt.read_manifest(tmp_path / "loop")
    with pytest.raises(InvalidArgumentError):
        unickpt.load_for_inference(ck, tp_rank=0, tp_size=0)
    with pytest.raises(LayoutError, match="no dimension"):
        unickpt.load_for_inference(ck, tp_rank=0, tp_size=2, tp_dim=lambda n, s: 1)  # 'norm' is 1-D
    good = json.loads((ck / "unickpt.json").read_bytes())
    for mutate, cmd in (
        (lambda m: m["saved_by"].update(nodes=5), "inspect"),
        (lambda m: m["saved_by"].update(strategy=[1]), "reshard"),
        (lambda m: m["compression"].update(eps="x"), "reshard"),
    ):
        m = json.loads(json.dumps(good))
        mutate(m)
        (ck / "unickpt.json").write_bytes(seal(m))
        args = [cmd, ck] + ([tmp_path / "re"] if cmd == "reshard" else [])
        r = cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    text = seal(good).replace(b'"lr":0.001', b'"lr":1e999')
    from tests.crafted import seal_text

    (ck / "unickpt.json").write_bytes(seal_text(text.decode()))
    with pytest.raises(FormatError, match="finite"):
        unickpt.read_manifest(ck)


def test_config_json_that_is_not_an_object_or_nests_deeply(tmp_path):
    from unickpt.export import export_hf

    for i, text in enumerate(["[1, 2]", "[" * 100000 + "]" * 100000]):
        p = tmp_path / f"c{i}"
        unickpt.save({"model": {"w": torch.ones(2)}}, p, extra_files={"config.json": text})
        with pytest.raises(FormatError, match="config.json"):
            export_hf(p, tmp_path / f"hf{i}")


def test_inspect_escapes_control_characters(ck):
    m = json.loads((ck / "unickpt.json").read_bytes())
    m["created"] = "\x1b]0;pwned\x07\x1b[2J"
    m["saved_by"]["unickpt_version"] = "\x1b[31m"
    (ck / "unickpt.json").write_bytes(seal(m))
    r = cli("inspect", ck)
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\\x1b" in r.stdout


def test_a_load_racing_an_overwrite_says_the_checkpoint_changed(ck, monkeypatch):
    from unickpt.loading import target as loader

    real = loader.validate

    def validate_then_overwrite(*a, **kw):
        out = real(*a, **kw)
        other = _state()
        other["model"]["big"] = torch.zeros(2 * H, H)  # other files, other sizes
        unickpt.save({"model": {**other["model"], "big": other["model"]["big"]}}, ck, overwrite=True)
        return out

    monkeypatch.setattr(loader, "validate", validate_then_overwrite)
    with pytest.raises(CheckpointChangedError, match="replaced"):
        unickpt.load({"model": {"big": torch.zeros(4 * H, H)}}, ck, group="local", strict=False)


# -- finding 5: concurrent saves to one path ----------------------------------------------------


def _save_proc(path, value, overwrite, fault, q, done=None):
    if fault:
        from tests import faulty

        faulty.mark_fault_points(writers=False)
        os.environ["FAULTY_PARK"] = fault
    try:
        unickpt.save({"model": {"w": torch.full((4,), float(value))}}, path, overwrite=overwrite)
        q.put((value, "ok"))
    except BaseException as e:
        q.put((value, type(e).__name__))
    finally:
        if done:
            open(done, "w").close()


@pytest.mark.parametrize("overwrite", [False, True])
def test_concurrent_saves_to_one_path_never_lose_the_winner(tmp_path, overwrite):
    p = str(tmp_path / "ck")
    if overwrite:
        unickpt.save({"model": {"w": torch.zeros(4)}}, p)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = str(tmp_path.parent / f"{tmp_path.name}-fast-done")  # outside tmp_path, listed below
    # the slow save waits before its commit until the fast one has finished (however slow
    # this machine is), so the fast one always commits first
    slow = ctx.Process(target=_save_proc, args=(p, 1, overwrite, f"before-commit:60:{done}", q))
    slow.start()
    deadline = time.monotonic() + 60
    while not [n for n in os.listdir(tmp_path) if ".tmp-" in n] and time.monotonic() < deadline:
        time.sleep(0.05)
    fast = ctx.Process(target=_save_proc, args=(p, 2, overwrite, "", q, done))
    fast.start()
    fast.join(60)
    slow.join(60)
    out = dict(q.get(timeout=5) for _ in range(2))
    assert out == {2: "ok", 1: CheckpointExistsError.__name__}, out
    t = {"model": {"w": torch.zeros(4)}}
    unickpt.load(t, p)
    assert torch.equal(t["model"]["w"], torch.full((4,), 2.0))
    assert os.listdir(tmp_path) == ["ck"]


def test_step_directories_that_are_links_are_not_checkpoints_of_the_root(tmp_path):
    outside = tmp_path / "elsewhere"
    unickpt.save({"model": {"w": torch.ones(2)}}, outside, step=9)
    root = tmp_path / "root"
    unickpt.save({"model": {"w": torch.zeros(2)}}, root / "step-00000001", step=1)
    os.symlink(outside, root / "step-00000009")
    assert unickpt.latest(root).endswith("step-00000001")
    t = {"model": {"w": torch.full((2,), 5.0)}}
    assert unickpt.load(t, root).step == 1 and torch.equal(t["model"]["w"], torch.zeros(2))


# -- found by an attacker's review of the fixes ---------------------------------------------------


@pytest.mark.parametrize("bad", ["dangling link", "garbage", "truncated data file"])
def test_retention_never_deletes_the_last_checkpoint_that_reads(tmp_path, bad):
    root = tmp_path / "root"
    unickpt.save({"model": {"w": torch.ones(2)}}, root / "step-00000001", step=1)
    if bad == "truncated data file":  # committed, its manifest reads, one file is cut short
        unickpt.save({"model": {"w": torch.ones(256)}}, root / "step-00000002", step=2)
        os.truncate(root / "step-00000002" / "model-00001-of-00001.safetensors", 100)
    else:
        (root / "step-00000002").mkdir()
    if bad == "dangling link":  # not a regular file: not a commit at all
        os.symlink("/nonexistent", root / "step-00000002" / "unickpt.json")
        assert unickpt.latest(root).endswith("step-00000001")
    elif bad == "garbage":  # a damaged manifest: committed by name, but it does not read
        (root / "step-00000002" / "unickpt.json").write_text("{garbage")
    assert unickpt.retain(root, 1) == []
    t = {"model": {"w": torch.zeros(2)}}
    unickpt.load(t, root / "step-00000001")
    assert torch.equal(t["model"]["w"], torch.ones(2))


def test_a_damaged_newest_step_fails_its_load_naming_the_older_ones(tmp_path):
    """load(root) loads the newest committed step or fails: it does not fall back by itself
    (the trainer's resume does); the error's note names the older committed steps."""
    root = tmp_path / "root"
    for step in (1, 2, 3):
        unickpt.save({"model": {"w": torch.full((256,), float(step))}}, root / f"step-{step:08d}", step=step)
    f = root / "step-00000003" / "model-00001-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    t = {"model": {"w": torch.zeros(256)}}
    with pytest.raises(ChecksumError) as ei:
        unickpt.load(t, root)
    assert ei.value.__notes__ == ["step-00000003 is the newest committed checkpoint under " + str(root) +
                                  "; older committed ones: step-00000002, step-00000001 (load one by its path)"]
    with pytest.raises(ChecksumError) as ei:  # named directly: no note
        unickpt.load(t, root / "step-00000003")
    assert not getattr(ei.value, "__notes__", None)
    assert unickpt.load(t, root / "step-00000002").step == 2 and torch.equal(t["model"]["w"], torch.full((256,), 2.0))
    f.unlink()  # a data file gone: the same note
    with pytest.raises(unickpt.errors.CheckpointNotFoundError) as ei:
        unickpt.load(t, root)
    assert "older committed ones: step-00000002, step-00000001" in ei.value.__notes__[0]


def test_a_step_directory_must_hold_its_step_or_it_is_neither_loaded_nor_kept_as_the_newest(tmp_path):
    """A copy of an older step under a newer step's name once passed for the newest: load(root)
    took it and retention deleted the real newest behind it. Names other than step_dirname's
    and torchtitan's unpadded one (step-013, other digits) are no step; a step-* name whose
    manifest says another step is refused by load(root) and stops retention."""
    import shutil

    root = tmp_path / "root"
    for step in (2, 4):
        unickpt.save({"model": {"w": torch.full((4,), float(step))}}, root / f"step-{step:08d}", step=step)
    shutil.copytree(root / "step-00000002", root / "step-013")
    shutil.copytree(root / "step-00000002", root / "step-\u0661\u0663")  # Arabic-Indic digits
    assert unickpt.latest(root).endswith("step-00000004")
    t = {"model": {"w": torch.zeros(4)}}
    assert unickpt.load(t, root).step == 4 and t["model"]["w"][0] == 4
    shutil.copytree(root / "step-00000002", root / "step-00000013")  # the name of a newer step
    with pytest.raises(FormatError, match="named step 13, but its manifest says step 2"):
        unickpt.load(t, root)
    assert unickpt.retain(root, 1) == []  # nothing deleted behind it
    assert (root / "step-00000004").is_dir() and (root / "step-00000002").is_dir()
    shutil.rmtree(root / "step-00000013")
    shutil.copytree(root / "step-00000002", root / "step-13")  # torchtitan's spelling of step 13: checked alike
    with pytest.raises(FormatError, match="named step 13, but its manifest says step 2"):
        unickpt.load(t, root)


def test_export_never_replaces_a_checkpoint_or_its_root(ck, tmp_path):
    root = tmp_path / "root"
    unickpt.save(_state(), root / "step-00000005", step=5)
    for dst in (root, root / "step-00000005", ck):
        r = cli("export", root / "step-00000005", dst, "--overwrite", "-q")
        assert r.returncode == 2 and "CheckpointExistsError" in r.stderr, (dst, r.stderr)
    assert unickpt.latest(root).endswith("step-00000005") and unickpt.read_manifest(ck)[1].step == 3


def test_bad_arguments_and_unwritable_destinations_raise_typed_errors(ck, tmp_path):
    """Out-of-range arguments are InvalidArgumentError (still a ValueError); a destination the
    storage cannot create is a StorageError naming it, not the hidden temporary."""
    from unickpt.errors import InvalidArgumentError, StorageError

    t = {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}}
    for kw in ({"verify": "bogus"}, {"bucket_bytes": 0}):
        with pytest.raises(InvalidArgumentError):
            unickpt.load(t, ck, **kw)
    with pytest.raises(InvalidArgumentError):
        unickpt.Compression(quant="O3")
    r = cli("export", ck, "/proc/unickpt-no-such-dir/out", "--json")
    got = json.loads(r.stdout)
    assert r.returncode == 2 and got["error"]["type"] == "StorageError", r.stdout
    assert "/proc/unickpt-no-such-dir/out" in got["error"]["message"] and ".tmp" not in got["error"]["message"], got
    with pytest.raises(StorageError, match="/proc/unickpt-x"):
        unickpt.save(_state(), "/proc/unickpt-x")


def test_overwrite_never_deletes_checkpoints_nested_deeper(tmp_path):
    """A folder an export would replace, or a checkpoint a save would replace, may hold
    committed checkpoints at any depth and under any name (a run's directory, a 'best' copy):
    both refuse, name the one found, and every checkpoint stays loadable, the export's
    own source included."""
    root = tmp_path / "root"
    src = root / "runs" / "run1" / "step-00000001"
    unickpt.save(_state(), src, step=1)
    unickpt.save(_state(), root / "best", step=9)
    r = cli("export", src, root, "--overwrite", "-q")
    assert r.returncode == 2 and "CheckpointExistsError" in r.stderr and "holds a committed checkpoint" in r.stderr, r.stderr
    r = cli("export", src, root / "runs", "--overwrite", "-q")  # its source, two levels down
    assert r.returncode == 2 and "step-00000001" in r.stderr, r.stderr
    outer = tmp_path / "outer"
    unickpt.save(_state(), outer, step=2)
    unickpt.save(_state(), outer / "inner", step=3)  # a checkpoint inside another one's directory
    with pytest.raises(CheckpointExistsError, match="holds another committed checkpoint"):
        unickpt.save(_state(), outer, step=4, overwrite=True)
    for p, step in ((src, 1), (root / "best", 9), (outer, 2), (outer / "inner", 3)):
        assert unickpt.read_manifest(p)[1].step == step
        assert cli("verify", p, "-q").returncode == 0, p


def test_retention_keeps_an_old_step_that_holds_another_checkpoint(tmp_path, caplog):
    """retain deletes old step checkpoints, superseded by newer ones; a checkpoint put inside
    an old step's directory (an export, a 'best' copy) is superseded by nothing: that step is
    kept, with a warning naming both, and the steps around it go as usual."""
    for step in (1, 2, 3, 4):
        unickpt.save(_state(), tmp_path / f"step-{step:08d}", step=step)
    inner = tmp_path / "step-00000002" / "exports" / "best"
    unickpt.save(_state(), inner, step=2)
    with caplog.at_level("WARNING", logger="unickpt"):
        gone = unickpt.retain(tmp_path, 1)
    assert sorted(os.path.basename(p) for p in gone) == ["step-00000001", "step-00000003"]
    assert "retention kept" in caplog.text and str(inner) in caplog.text, caplog.text
    assert unickpt.read_manifest(inner)[1].step == 2 and unickpt.read_manifest(tmp_path / "step-00000002")[1].step == 2
    assert unickpt.latest(tmp_path) == str(tmp_path / "step-00000004")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_checks_dcp_claims_before_allocating_or_creating(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.randn(16, 16)}}, checkpoint_id=str(d), no_dist=True)
    md = pickle.loads((d / ".metadata").read_bytes())  # our own file: trusted here
    md.state_dict_metadata["model.w"].size = torch.Size([1 << 30, 16])
    md.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([1 << 30, 16])
    (d / ".metadata").write_bytes(pickle.dumps(md))
    r = cli("convert", "--from-dcp", d, tmp_path / "uni", "-q")
    assert r.returncode == 2 and "claims" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["dcp"]


def test_manifest_cap_counts_only_the_data_files_on_disk(ck):
    with open(ck / "junk", "wb") as f:  # 400 MB that take no disk space, and not a data file
        f.truncate(400 << 20)
    m = json.loads((ck / "unickpt.json").read_bytes())
    m["extra"] = {"pad": "-9," * (20 << 20)}  # 60 MB: more than 16 MiB + 4x the ~4 MB of data
    (ck / "unickpt.json").write_bytes(seal(m))
    with pytest.raises(FormatError, match="larger than"):
        unickpt.read_manifest(ck)


def test_cli_sizes_are_checked(ck, tmp_path):
    for size in ("1e400G", "-5", "x"):
        r = cli("export", ck, tmp_path / "hf", "--max-shard-size", size, "-q")
        assert r.returncode == 2 and "InvalidArgumentError" in r.stderr, r.stderr


def test_a_temporary_without_owner_record_is_swept_after_a_short_grace(tmp_path):
    left = tmp_path / ".step-00000002.tmp-00000000000000cc"  # killed between mkdir and the record
    left.mkdir()
    assert unickpt.sweep(tmp_path) == []
    old = time.time() - 120
    os.utime(left, (old, old))
    assert unickpt.sweep(tmp_path) == [str(left)]


def test_coded_windows_decode_only_verified_bytes(tmp_path, monkeypatch):
    """O1 moments read window by window (windows shrunk to force many): sliced loads equal the
    whole decode, and a flipped code byte in the slice is caught."""
    from unickpt.loading import coded

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g)
    sd = {"model": {"w": w.to(torch.bfloat16)}, "optimizer": {"w.exp_avg": torch.randn(64, 96, generator=g) * 1e-3,
                                                             "w.exp_avg_sq": torch.rand(64, 96, generator=g) * 1e-6}}
    p = tmp_path / "o1"
    unickpt.save(sd, p, quant="O1")
    whole = {"optimizer": {"w.exp_avg": torch.zeros(64, 96)}}
    unickpt.load(whole, p, group="local", strict=False)
    monkeypatch.setattr(coded, "CODED_WINDOW", 200)
    for target in (unickpt.shard(torch.zeros(64, 40), (64, 96), offsets=(0, 50)),
                   unickpt.shard(torch.zeros(1000), (64, 96), flat=(1234, 2234))):
        unickpt.load({"optimizer": {"w.exp_avg": target}}, p, group="local", strict=False)
        full = whole["optimizer"]["w.exp_avg"]
        expect = full[:, 50:90] if target.local.dim() == 2 else full.reshape(-1)[1234:2234]
        assert torch.equal(target.local, expect)
    _, man = unickpt.read_manifest(p)
    t = man.tensors[("optimizer", "w.exp_avg")]
    part = t.parts["codes"]
    _flip(p / t.file, man.files[t.file].data_start + part.begin + 30 * 96 + 60)  # row 30, column 60
    with pytest.raises(ChecksumError):
        unickpt.load({"optimizer": {"w.exp_avg": unickpt.shard(torch.zeros(64, 40), (64, 96), offsets=(0, 50))}},
                     p, group="local", strict=False)


def test_a_load_racing_retention_says_the_checkpoint_changed(tmp_path, monkeypatch):
    from unickpt.loading import target as loader

    root = tmp_path / "root"
    unickpt.save(_state(), root / "step-00000001", step=1)
    real = loader.validate

    def validate_then_retire(*a, **kw):  # a newer save commits, retention removes the one being read
        out = real(*a, **kw)
        unickpt.save(_state(), root / "step-00000002", step=2)
        unickpt.retain(root, 1)
        return out

    monkeypatch.setattr(loader, "validate", validate_then_retire)
    with pytest.raises(CheckpointChangedError, match="replaced or removed"):
        unickpt.load({"model": {"big": torch.zeros(4 * H, H)}}, root, group="local", strict=False)


def test_verify_flags_a_config_json_the_manifest_does_not_list(tmp_path):
    p = tmp_path / "ck"
    unickpt.save({"model": {"w": torch.ones(2)}}, p)
    (p / "config.json").write_text('{"api_key": "x"}')
    r = cli("verify", p, "-q")
    assert r.returncode == 1 and "config.json" in r.stderr and "not part of the checkpoint" in r.stderr


def test_verify_names_entries_the_manifest_does_not_list_without_failing(tmp_path):
    """A stray safetensors file (or anything else) in a checkpoint is never read, so the
    checkpoint verifies; the command says which entries are not part of it."""
    import json

    p = tmp_path / "ck"
    unickpt.save({"model": {"w": torch.ones(2)}}, p)
    (p / "model-00002-of-00002.safetensors").write_bytes(b"x" * 64)
    (p / "notes").mkdir()
    r = cli("verify", p, "-q")
    assert r.returncode == 0 and r.stdout.startswith("ok: 1 tensors"), r
    assert "2 entries of" in r.stderr and "model-00002-of-00002.safetensors, notes" in r.stderr, r.stderr
    r = cli("verify", p, "-q", "--json")
    obj = json.loads(r.stdout)
    assert obj["ok"] and obj["unlisted"] == ["model-00002-of-00002.safetensors", "notes"]
    assert len(obj["warnings"]) == 1 and "not part of the checkpoint" in obj["warnings"][0]
    got = {"model": {"w": torch.zeros(2)}}
    unickpt.load(got, p)
    assert torch.equal(got["model"]["w"], torch.ones(2))
    f = p / "model-00001-of-00001.safetensors"  # damaged too: the unlisted entries are still named
    b = bytearray(f.read_bytes())
    b[-1] ^= 1
    f.write_bytes(bytes(b))
    r = cli("verify", p, "-q", "--json")
    obj = json.loads(r.stdout)
    assert r.returncode == 1 and obj["unlisted"] == ["model-00002-of-00002.safetensors", "notes"] and obj["bad"]


def test_a_damaged_model_weight_under_a_residual_master_is_named_as_the_damaged_file(tmp_path):
    """A residual master is decoded from its model weight's bytes: when those are damaged, the
    error and .bad name the model's file and tensor (the master's file is intact), once."""
    w = torch.randn(64, 64)
    unickpt.save({"model": {"w": w.bfloat16()}, "master": {"w": w}}, tmp_path / "c", master="residual")
    _flip_tensor(tmp_path / "c", "w", 100)
    _, man = unickpt.read_manifest(tmp_path / "c")
    model_file = man.tensors[("model", "w")].file
    for target in ({"master": {"w": torch.zeros(64, 64)}},
                   {"model": {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}, "master": {"w": torch.zeros(64, 64)}}):
        with pytest.raises(ChecksumError) as e:
            unickpt.load(target, tmp_path / "c")
        assert e.value.bad == [(model_file, "w")] and model_file in str(e.value), (e.value, e.value.bad)
