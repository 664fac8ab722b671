"""Untrusted torch.distributed.checkpoint directories: metadata is unpickled only through an
allow-list, data files are regular files inside the directory (unickpt.dcp_safe)."""

import importlib.util
import os
import pickle
import shutil
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from unickpt import dcp_safe
from unickpt.dcp_safe import SafeFileSystemReader, read_dcp_metadata
from unickpt.errors import FormatError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("dcp_attacks", os.path.join(HERE, "attacks", "dcp", "make.py"))
attacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attacks)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]


def _state():
    g = torch.Generator().manual_seed(0)
    sd = {f"t.{str(dt).split('.')[-1]}": torch.randn(3, 4, generator=g).to(dt) for dt in DTYPES}
    sd.update({
        "model": {"layer": {"w": torch.randn(4, 4, generator=g), "b": torch.zeros(4)}, "scalar": torch.tensor(2.5),
                  "empty": torch.empty(0, 3)},
        "optim": {"state": {0: {"exp_avg": torch.ones(4), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 7, "name": "run-1", "lst": [1, "a", None], "flag": True,
    })
    return sd


def _save(path, state=None, **writer_kw):
    state = _state() if state is None else state
    dcp.save(state, storage_writer=FileSystemWriter(str(path), **writer_kw), no_dist=True)
    return path


def _zeros_like_tensors(md):
    return {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def _flat_tensors(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _guard(fn, timeout=60.0, unblock=None):
    """Run ``fn`` in a thread; fail (instead of hanging) if it does not return in time.
    ``timeout`` is a hang guard only: what it guards returns in milliseconds or blocks for
    ever (an open of a FIFO nobody writes), so no normal run comes near it."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if unblock:
            unblock()
        pytest.fail(f"{fn} blocked for more than {timeout} s")
    return box


# -- real checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("writer_kw", [{}, {"single_file_per_rank": False}, {"_extensions": [ZStandard()]}],
                         ids=["default", "file-per-item", "zstd"])
def test_real_checkpoint_matches_dcp_reader(tmp_path, writer_kw):
    if writer_kw.get("_extensions") and not ZStandard.is_available():
        pytest.skip("zstandard not installed")
    d = _save(tmp_path / "dcp", **writer_kw)
    ours = read_dcp_metadata(d)
    theirs = FileSystemReader(str(d)).read_metadata()
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata)
    n_tensors = 0
    for k, m in theirs.state_dict_metadata.items():
        o = ours.state_dict_metadata[k]
        assert type(o) is type(m)
        if isinstance(m, TensorStorageMetadata):
            n_tensors += 1
            assert o.size == m.size and o.properties.dtype == m.properties.dtype and o.chunks == m.chunks
            assert o.properties.layout == m.properties.layout
            assert o.properties.memory_format == m.properties.memory_format
    assert n_tensors == len(DTYPES) + 6
    assert isinstance(ours.state_dict_metadata["step"], BytesStorageMetadata)
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data and ours.version == theirs.version
    assert ours.storage_meta.checkpoint_id == theirs.storage_meta.checkpoint_id  # PurePosixPath == PosixPath


@pytest.mark.parametrize("writer_kw", [{}, {"_extensions": [ZStandard()]}], ids=["default", "zstd"])
def test_safe_reader_loads_tensors(tmp_path, writer_kw):
    if writer_kw.get("_extensions") and not ZStandard.is_available():
        pytest.skip("zstandard not installed")
    state = _state()
    d = _save(tmp_path / "dcp", state, **writer_kw)
    md = read_dcp_metadata(d)
    want = _flat_tensors(state)
    for reader in (SafeFileSystemReader(d), SafeFileSystemReader(str(d), metadata=md)):
        got = _zeros_like_tensors(md)
        dcp.load(got, storage_reader=reader, no_dist=True)
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), k


def test_cached_metadata_is_not_read_again(tmp_path):
    d = _save(tmp_path / "dcp")
    md = read_dcp_metadata(d)
    os.unlink(d / ".metadata")
    got = {"model.layer.w": torch.zeros(4, 4)}
    dcp.load(got, storage_reader=SafeFileSystemReader(d, metadata=md), no_dist=True)
    assert got["model.layer.w"].abs().sum() > 0


# -- crafted metadata ---------------------------------------------------------------------

REFUSED = {
    "os_system": "'os.system'",
    "builtins_exec": "'builtins.exec'",
    "builtins_eval": "'builtins.eval'",
    "subprocess_popen": "'subprocess.Popen'",
    "torch_load": "'torch.load'",
    "torch_rebuild_tensor_v2": "'torch._utils._rebuild_tensor_v2'",
    "dotted_os_system": "'torch.distributed.checkpoint.metadata.os.system'",
    "dotted_pickle_loads": "'torch.distributed.checkpoint.filesystem.pickle.loads'",
    "nested_posix_system": "'posix.system'",
}
MALFORMED = {
    "persistent_id": "not a DCP metadata pickle",
    "truncated": "not a DCP metadata pickle",
    "garbage": "not a DCP metadata pickle",
    "empty": "not a DCP metadata pickle",
    "plain_dict": "holds a dict, not torch.distributed.checkpoint Metadata",
    "deep_list": "holds a list",
    "relative_path_parent": "'../x'",
    "relative_path_absolute": "'/etc/passwd'",
    "relative_path_subdir": "'sub/x'",
    "relative_path_hidden": "'.metadata'",
    "relative_path_nul": "'x\\x00y'",
    "relative_path_backslash": "'..\\\\x'",
}


def test_attack_list_is_complete():
    assert set(attacks.payloads("m")) == set(REFUSED) | set(MALFORMED)


def test_recorded_payloads_match_script():
    rec = os.path.join(HERE, "attacks", "dcp")
    for name, data in attacks.payloads(attacks.MARKER_NAME).items():
        with open(os.path.join(rec, f"{name}.metadata"), "rb") as f:
            assert f.read() == data, f"tests/attacks/dcp/{name}.metadata is stale: run make.py"


def _plant(tmp_path, name, filename=".metadata"):
    marker = tmp_path / "marker"
    d = tmp_path / "dcp"
    d.mkdir()
    (d / filename).write_bytes(attacks.payloads(str(marker))[name])
    return d, marker


@pytest.mark.parametrize("name", sorted(REFUSED) + sorted(MALFORMED))
def test_crafted_metadata_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    d, marker = _plant(tmp_path, name)
    with pytest.raises(FormatError) as e:
        read_dcp_metadata(d)
    msg = str(e.value)
    assert str(d / ".metadata") in msg
    if name in REFUSED:
        assert f"refuses to unpickle {REFUSED[name]}" in msg
        assert "only torch.distributed.checkpoint metadata classes are allowed" in msg
    else:
        assert MALFORMED[name] in msg
        if name.startswith("relative_path"):
            assert "bare file names" in msg
    with pytest.raises(FormatError):
        SafeFileSystemReader(d).read_metadata()
    time.sleep(0.05)  # a spawned process (Popen) would have had time to create it
    assert not marker.exists() and not (tmp_path / attacks.MARKER_NAME).exists()


def test_payloads_do_run_under_plain_pickle(tmp_path, monkeypatch):
    """Control: the payloads are real attacks: DCP's own reader runs them (harmlessly)."""
    monkeypatch.chdir(tmp_path)
    d, marker = _plant(tmp_path, "builtins_exec")
    with pytest.raises(Exception):  # exec returns None: DCP then fails on it, after the fact
        FileSystemReader(str(d)).read_metadata()
    assert marker.read_text() == "pwned"


def test_rank_local_fallback_is_restricted_too(tmp_path, monkeypatch):
    """dcp.load swallows a failing .metadata and unpickles __<rank>.metadata instead."""
    monkeypatch.chdir(tmp_path)
    d, marker = _plant(tmp_path, "builtins_exec", "__0.metadata")
    with pytest.raises(BaseException) as e:
        dcp.load({"w": torch.zeros(2)}, storage_reader=SafeFileSystemReader(d), no_dist=True)
    assert "refuses to unpickle 'builtins.exec'" in str(e.value)
    assert not marker.exists()
    with pytest.raises(FormatError, match="refuses to unpickle 'builtins.exec'"):
        SafeFileSystemReader(d).read_metadata(rank=0)
    assert not marker.exists()


def test_chunk_outside_tensor_is_refused(tmp_path):
    md = attacks.metadata()
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([3])
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(FormatError, match="chunk outside its size"):
        read_dcp_metadata(tmp_path)


@pytest.mark.parametrize("field,value", [("offset", -1), ("length", "10"), ("offset", True),
                                         ("transform_descriptors", [b"stream.zstd/1"])])
def test_malformed_storage_info_is_refused(tmp_path, field, value):
    md = attacks.metadata()
    setattr(next(iter(md.storage_data.values())), field, value)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(FormatError, match="malformed"):
        read_dcp_metadata(tmp_path)


def test_well_formed_crafted_metadata_is_accepted(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(attacks.metadata(), protocol=4))
    md = read_dcp_metadata(tmp_path)
    assert md == attacks.metadata()


def test_find_class_allow_list():
    u = dcp_safe._MetadataUnpickler(open(os.devnull, "rb"))
    assert u.find_class("torch", "float32") is torch.float32
    assert u.find_class("torch", "Size") is torch.Size
    assert u.find_class("torch.serialization", "_get_layout")("torch.strided") is torch.strided
    for bad in ("torch.load", "torch.sparse_coo.__class__", "builtins.eval", "os.system"):
        with pytest.raises(pickle.UnpicklingError):
            u.find_class("torch.serialization", "_get_layout")(bad)
    for mod, name in [("torch", "load"), ("torch", "Tensor"), ("torch", "strided"), ("torch", "contiguous_format"),
                      ("torch", "float32.__class__"), ("builtins", "getattr"), ("builtins", "__import__"),
                      ("copyreg", "_reconstructor"), ("collections", "OrderedDict"), ("posix", "system"),
                      ("torch.distributed.checkpoint.metadata", "os"), ("pathlib", "Path")]:
        with pytest.raises(pickle.UnpicklingError):
            u.find_class(mod, name)


# -- the files themselves -----------------------------------------------------------------


def test_metadata_symlink_is_refused(tmp_path):
    real = _save(tmp_path / "real")
    d = tmp_path / "dcp"
    d.mkdir()
    os.symlink(real / ".metadata", d / ".metadata")
    box = _guard(lambda: read_dcp_metadata(d))
    assert isinstance(box.get("error"), FormatError) and "symbolic link" in str(box["error"])


def test_metadata_fifo_does_not_block(tmp_path):
    d = tmp_path / "dcp"
    d.mkdir()
    fifo = d / ".metadata"
    os.mkfifo(fifo)

    def unblock():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    box = _guard(lambda: read_dcp_metadata(d), unblock=unblock)
    assert isinstance(box.get("error"), FormatError) and "FIFO" in str(box["error"])


def test_metadata_directory_and_missing(tmp_path):
    (tmp_path / "a" / ".metadata").mkdir(parents=True)
    with pytest.raises(FormatError, match="a directory, not a regular file"):
        read_dcp_metadata(tmp_path / "a")
    with pytest.raises(FormatError, match="no such file"):
        read_dcp_metadata(tmp_path / "nothing")
    with pytest.raises(FormatError, match="not a DCP metadata file name"):
        read_dcp_metadata(tmp_path / "a", "../.metadata")


def test_metadata_size_cap(tmp_path, monkeypatch):
    d = _save(tmp_path / "dcp")
    monkeypatch.setattr(dcp_safe, "MAX_METADATA_BYTES", 100)
    with pytest.raises(FormatError, match="more than the 100 bytes"):
        read_dcp_metadata(d)


def test_data_file_symlink_is_refused(tmp_path):
    d = _save(tmp_path / "dcp")
    outside = tmp_path / "outside.distcp"
    shutil.move(d / "__0_0.distcp", outside)
    os.symlink(outside, d / "__0_0.distcp")
    got = {"model.layer.w": torch.zeros(4, 4)}
    dcp.load(got, storage_reader=FileSystemReader(str(d)), no_dist=True)  # DCP's own reader follows it
    with pytest.raises(BaseException) as e:  # dcp.load wraps reader errors in CheckpointException
        dcp.load(got, storage_reader=SafeFileSystemReader(d), no_dist=True)
    assert "symbolic link" in str(e.value)


def test_data_file_fifo_does_not_block(tmp_path):
    d = _save(tmp_path / "dcp")
    os.unlink(d / "__0_0.distcp")
    os.mkfifo(d / "__0_0.distcp")

    def unblock():
        os.close(os.open(d / "__0_0.distcp", os.O_WRONLY | os.O_NONBLOCK))

    box = _guard(lambda: dcp.load({"model.layer.w": torch.zeros(4, 4)}, storage_reader=SafeFileSystemReader(d),
                                  no_dist=True), unblock=unblock)
    assert "error" in box and "FIFO" in str(box["error"])


def test_reader_file_system_is_confined(tmp_path):
    d = _save(tmp_path / "dcp")
    (tmp_path / "x").write_bytes(b"secret")
    fs = SafeFileSystemReader(d).fs
    with fs.create_stream(d / "__0_0.distcp", "rb") as f:
        assert f.read(2)
    for bad in (d / ".." / "x", tmp_path / "x", d / "sub" / "x", d / ".hidden"):
        with pytest.raises(FormatError, match="not a file directly inside"):
            with fs.create_stream(bad, "rb"):
                pass
    with pytest.raises(FormatError, match="read-only"):
        with fs.create_stream(d / "new", "wb"):
            pass
    with pytest.raises(FormatError):
        fs.rm_file(d / "__0_0.distcp")
    assert (d / "__0_0.distcp").exists()


def test_set_up_storage_reader_validates(tmp_path):
    """Metadata that did not come from read_dcp_metadata (another rank's, a caller's) is checked."""
    d = _save(tmp_path / "dcp")
    md = FileSystemReader(str(d)).read_metadata()
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"
    with pytest.raises(FormatError, match="bare file names"):
        SafeFileSystemReader(d).set_up_storage_reader(md, True)
    with pytest.raises(FormatError, match="bare file names"):
        SafeFileSystemReader(d, metadata=md)


def test_convert_from_dcp_refuses_crafted_metadata(tmp_path, monkeypatch):
    """`unickpt convert --from-dcp` on a .metadata whose pickle calls os.system: FormatError,
    the command never runs, no destination is left behind."""
    from unickpt.offline import convert_from_dcp

    monkeypatch.chdir(tmp_path)
    d, marker = _plant(tmp_path, "os_system")
    with pytest.raises(FormatError, match="refuses to unpickle 'os.system'"):
        convert_from_dcp(d, tmp_path / "uni")
    time.sleep(0.05)
    assert not marker.exists() and not (tmp_path / "uni").exists()
    os.rename(d / ".metadata", d / "__0.metadata")  # dcp.load's rank-local fallback is no way around it
    with pytest.raises(FormatError):
        convert_from_dcp(d, tmp_path / "uni")
    assert not marker.exists() and not (tmp_path / "uni").exists()


def test_convert_from_dcp_refuses_symlinked_data_file(tmp_path):
    from unickpt.offline import convert_from_dcp

    d = _save(tmp_path / "dcp", {"model": {"w": torch.randn(4, 4)}, "step": 1})
    shutil.move(d / "__0_0.distcp", tmp_path / "outside.distcp")
    os.symlink(tmp_path / "outside.distcp", d / "__0_0.distcp")
    with pytest.raises(FormatError, match="symbolic link"):
        convert_from_dcp(d, tmp_path / "uni")
    assert not (tmp_path / "uni").exists()
