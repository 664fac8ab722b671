"""Object stores behind the one write transaction: ``s3://`` against a real S3-protocol
server on 127.0.0.1 (moto, its own process; the ``s3`` fixture fails the test if it cannot
start), with both S3 clients (obstore, s3fs), and ``memory://`` round trips.

Ranks are real processes on gloo; the AWS environment the fixture sets is passed to them
(``_env``), subprocesses get it whole (``s3.environ()``): tests/s3server.offline_env, under
which nothing leaves the loopback interface (test_no_connection_leaves_this_machine).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import unickpt
from tests import dist
from tests.clirun import cli
from tests.layouts import assert_same, build, reference, zeros_like_full
from tests.test_quant_matrix import expected, reference_q
from unickpt.errors import (CheckpointExistsError, CheckpointNotFoundError, InvalidArgumentError, StorageError,
                            UnickptError)

CLIENTS = ["obstore", "s3fs"]


def _env(s3, client):
    return {**s3.env, "UNICKPT_S3_CLIENT": client}


def _save(rank, world, url, layout, kw):
    sd = build(layout, reference(), rank, world)
    sd["step"] = 3
    r = unickpt.save(sd, url, step=3, bucket_bytes=1 << 14, **kw)
    if kw.get("async_save"):
        r = r.wait()
    return r.files


def _load(rank, world, url, layout):
    ref = reference()
    target = build(layout, zeros_like_full(ref), rank, world)
    target["step"] = -1
    res = unickpt.load(target, url)
    assert target.pop("step") == 3
    assert_same(target, build(layout, ref, rank, world), f"{url} -> {layout} (rank {rank})")
    return res.bytes_read


def _objects(url):
    from unickpt.io.storage import storage_for

    st, p = storage_for(url)
    return sorted(m.key for m in st.list_objects(p))


@pytest.mark.parametrize("client", CLIENTS)
def test_s3_save_on_4_ranks_loads_bit_exact_on_3_and_1(s3, client):
    url = s3.bucket("ck-" + client) + "/run/step-00000003"
    env = _env(s3, client)
    dist.run(_save, 4, url, "tp2zero2", {}, env=env)
    objs = _objects(url)
    assert "unickpt.json" in objs
    data = [o for o in objs if o.endswith(".safetensors")]
    assert data and all(len(o.split(".")) == 3 for o in data), objs  # role-N-of-M.TOKEN.safetensors
    assert not [o for o in objs if o.startswith(".owner-")], objs  # the owner record went with the commit
    for world, layout in ((3, "zero3"), (3, "tpcol3"), (1, "full1")):
        dist.run(_load, world, url, layout, env=env)
    os.environ["UNICKPT_S3_CLIENT"] = client
    try:
        assert unickpt.latest(s3.bucket("ck-" + client) + "/run") == url
    finally:
        del os.environ["UNICKPT_S3_CLIENT"]


def test_s3_async_save_and_compressed_o1_save(s3, tmp_path):
    root = s3.bucket("ck-async")
    env = _env(s3, "obstore")
    dist.run(_save, 2, root + "/a", "zero2", {"async_save": True}, env=env)
    dist.run(_load, 1, root + "/a", "full1", env=env)
    # O1 moments + residual masters: the object store holds what a local save holds
    dist.run(_save_q, 2, root + "/q", env=env)
    dist.run(_save_q, 2, str(tmp_path / "q"))
    got, want = dist.run(_load_q, 1, root + "/q", env=env)[0], dist.run(_load_q, 1, str(tmp_path / "q"))[0]
    assert got == want


def _save_q(rank, world, url):
    unickpt.save(build("zero2", reference_q(), rank, world), url, quant="O1", master="residual", bucket_bytes=4096)


def _load_q(rank, world, url):
    ref = reference_q()
    target = build("full1", zeros_like_full(ref), rank, world)
    unickpt.load(target, url, verify="full")
    assert_same(target, build("full1", expected(ref, "O1"), rank, world), url)
    _, man = unickpt.read_manifest(url)
    return sorted((f"{r}/{n}", t.codec) for (r, n), t in man.tensors.items())


def _save_nodes(rank, world, url):
    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"
    return _save(rank, world, url, "zero2", {})


def _load_nodes(rank, world, url):
    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"
    return _load(rank, world, url, "tpcol2")


def test_s3_node_local_prefixes(s3):
    root = s3.bucket("ck-nodes")
    url = root + "/{node}/ck"
    env = _env(s3, "obstore")
    dist.run(_save_nodes, 2, url, env=env)
    for n in ("n0", "n1"):  # every node's prefix has its own files and the full manifest
        objs = _objects(f"{root}/{n}/ck")
        assert "unickpt.json" in objs and any(o.endswith(".safetensors") for o in objs)
    dist.run(_load_nodes, 2, url, env=env)


def _save_one(url, step, value, **kw):
    unickpt.save({"model": {"w": torch.full((64, 64), float(value))}, "step": step}, url, step=step, **kw)


def _value(url):
    sd = {"model": {"w": torch.zeros(64, 64)}, "step": -1}
    unickpt.load(sd, url)
    return float(sd["model"]["w"][0, 0]), sd["step"]


def test_retention_keep_1_across_a_failing_save(s3, monkeypatch):
    root = s3.bucket("ck-keep") + "/run"
    for step in (1, 2):
        _save_one(f"{root}/step-{step:08d}", step, step)
    from unickpt.io.objstore import ObjectStorage

    def refuse(self, path, data, **kw):
        raise StorageError(5, "injected: the commit marker could not be written", path)

    monkeypatch.setattr(ObjectStorage, "put_marker", refuse)
    with pytest.raises(StorageError, match="injected"):
        _save_one(f"{root}/step-00000003", 3, 3)
    monkeypatch.undo()
    assert _objects(f"{root}/step-00000003") == []  # the failed save left nothing behind
    assert unickpt.latest(root) == f"{root}/step-00000002"
    assert unickpt.retain(root, 1) == [f"{root}/step-00000001"]
    assert unickpt.retain(root, 1) == []  # the newest committed one is never deleted
    assert _objects(f"{root}/step-00000001") == []
    assert _value(root) == (2.0, 2)


def test_an_overwrite_keeps_the_old_checkpoint_loadable_until_the_new_manifest_lands(s3, monkeypatch):
    url = s3.bucket("ck-over") + "/ck"
    _save_one(url, 1, 1.0)
    with pytest.raises(CheckpointExistsError):
        _save_one(url, 2, 2.0)
    before = _objects(url)
    from unickpt.io.objstore import ObjectStorage

    real = ObjectStorage.put_marker
    seen = {}

    def check_then_fail(self, path, data, **kw):
        seen["old"] = _value(url)  # the new data are all written: the old checkpoint still loads
        raise StorageError(5, "injected", path)

    monkeypatch.setattr(ObjectStorage, "put_marker", check_then_fail)
    with pytest.raises(StorageError):
        _save_one(url, 2, 2.0, overwrite=True)
    assert seen["old"] == (1.0, 1)
    assert _objects(url) == before and _value(url) == (1.0, 1)
    monkeypatch.setattr(ObjectStorage, "put_marker", real)
    _save_one(url, 2, 2.0, overwrite=True)
    assert _value(url) == (2.0, 2)
    old_data = [o for o in before if o.endswith(".safetensors")]
    assert not set(old_data) & set(_objects(url))  # the replaced data went after the commit


@pytest.mark.parametrize("client", CLIENTS)
def test_two_writes_to_one_prefix_commit_once(s3, client):
    from unickpt.io.commit import Transaction
    from unickpt.io.storage import storage_for

    url = s3.bucket("ck-race") + f"/{client}"
    st, p = storage_for(url, {"client": client})
    a, b = Transaction(st, p), Transaction(st, p)
    a.begin()
    b.begin()
    st.write_bytes(a.path(a.file_name("model-00000-of-00001.safetensors")), b"a")
    st.write_bytes(b.path(b.file_name("model-00000-of-00001.safetensors")), b"b")
    a.commit(b'{"a": 1}')
    with pytest.raises(CheckpointExistsError):
        b.commit(b'{"b": 1}')
    b.abort()
    assert st.read_bytes(st.join(p, "unickpt.json"), 100) == b'{"a": 1}'
    assert [o for o in _objects(url) if o.endswith(".safetensors")] == [a.file_name("model-00000-of-00001.safetensors")]


_KILLED = """
import sys
sys.path.insert(0, sys.argv[2])
import torch, unickpt
from tests import faulty
faulty.mark_fault_points(writers=False)
unickpt.save({"model": {"w": torch.ones(256, 256)}}, sys.argv[1])
"""


def test_a_save_killed_before_its_commit_is_invisible_and_swept(s3):
    url = s3.bucket("ck-kill") + "/run/step-00000001"
    env = s3.environ({"FAULTY_PARK": "before-commit:600"})  # parked at the manifest's put until killed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-c", _KILLED, url, root], env=env)
    deadline = time.monotonic() + 60  # a hang guard only
    while time.monotonic() < deadline and not any(o.endswith(".safetensors") for o in _objects(url)):
        time.sleep(0.2)
    time.sleep(0.5)
    p.kill()
    p.wait()
    objs = _objects(url)
    assert any(o.endswith(".safetensors") for o in objs) and "unickpt.json" not in objs
    assert unickpt.latest(s3.bucket("ck-kill") + "/run") is None
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        unickpt.load({"model": {"w": torch.zeros(256, 256)}}, url)
    removed = unickpt.sweep(s3.bucket("ck-kill") + "/run")  # the owner (this host's pid) is dead
    assert removed and _objects(url) == []


def test_cli_inspect_verify_export_on_s3_urls(s3, tmp_path):
    root = s3.bucket("ck-cli")
    url = root + "/ck"
    cfg = '{"model_type": "llama"}'
    unickpt.save({"model": {"model.w": torch.arange(12.0).view(3, 4)}}, url, step=4, extra_files={"config.json": cfg})
    r = cli("inspect", url)
    assert r.returncode == 0 and "step 4" in r.stdout, r.stderr
    r = cli("verify", url)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr
    r = cli("export", url, str(tmp_path / "hf"), "-q")  # object store -> local folder
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    files = sorted(os.listdir(tmp_path / "hf"))
    assert "config.json" in files
    got = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(str(tmp_path / "hf" / f)).items()}
    assert torch.equal(got["model.w"], torch.arange(12.0).view(3, 4))
    r = cli("export", url, root + "/hf", "-q")  # and into the object store
    assert r.returncode == 0, r.stderr
    assert "config.json" in _objects(root + "/hf")
    r = cli("reshard", url, root + "/ck2", "-q")
    assert r.returncode == 0, r.stderr
    assert cli("verify", root + "/ck2").returncode == 0
    # a damaged object: verify names it and fails
    c = s3.client()
    key = next(o for o in _objects(url) if o.endswith(".safetensors"))
    body = bytearray(c.get_object(Bucket="ck-cli", Key="ck/" + key)["Body"].read())
    body[-1] ^= 1
    c.put_object(Bucket="ck-cli", Key="ck/" + key, Body=bytes(body))
    r = cli("verify", url)
    assert r.returncode == 1 and key in r.stderr


def test_memory_url_round_trip():
    root = "memory://unickpt-test/run"
    for step in (1, 2, 3):
        _save_one(f"{root}/step-{step:08d}", step, step)
    assert unickpt.latest(root) == f"{root}/step-00000003"
    assert _value(root) == (3.0, 3)
    assert unickpt.retain(root, 2) == [f"{root}/step-00000001"]
    with pytest.raises(CheckpointExistsError):
        _save_one(f"{root}/step-00000003", 3, 9)
    _save_one(f"{root}/step-00000003", 3, 9, overwrite=True)
    assert _value(root) == (9.0, 3)
    w = unickpt.load_for_inference(root)
    assert torch.equal(w["w"], torch.full((64, 64), 9.0))
    _, man = unickpt.read_manifest(root)
    assert man.step == 3


def test_a_prefix_without_manifest_is_not_a_checkpoint():
    from unickpt.io.storage import storage_for

    st, p = storage_for("memory://unickpt-test/junk/step-00000001")
    st.write_bytes(st.join(p, "model-00000-of-00001.0123456789abcdef.safetensors"), b"x" * 100)
    assert unickpt.latest("memory://unickpt-test/junk") is None
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        unickpt.read_manifest(p)

    r = cli("inspect", p)
    assert r.returncode == 2 and "CheckpointNotFoundError" in r.stderr


def test_bad_urls_and_stores_give_typed_errors(s3):
    with pytest.raises(StorageError, match="nosuchscheme"):
        unickpt.latest("nosuchscheme://bucket/x")
    with pytest.raises(UnickptError, match="s3://no-such-bucket-unickpt"):
        _save_one("s3://no-such-bucket-unickpt/x", 1, 1)
    with pytest.raises(InvalidArgumentError, match="client"):
        unickpt.latest("s3://b/x", storage_options={"client": "nope"})
    with pytest.raises(InvalidArgumentError, match="not understood"):
        unickpt.latest("s3://b/x", storage_options={"bogus_option": 1})


@pytest.mark.parametrize("client", CLIENTS)
def test_a_server_dropping_the_upload_fails_typed_and_keeps_the_previous_checkpoint(s3, client, monkeypatch):
    from tests.s3server import DroppingProxy

    root = s3.bucket("ck-drop") + "/" + client
    _save_one(root + "/step-00000001", 1, 1.0)
    proxy = DroppingProxy(s3.port, limit=256 << 10)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with pytest.raises(StorageError, match="step-00000002") as info:
            unickpt.save({"model": {"w": torch.ones(1024, 1024)}}, root + "/step-00000002",
                         storage_options={"client": client}, timeout_s=120)
        assert not dist.waited_out(str(info.value)), info.value  # the dropped upload's error, not a timeout
        assert proxy.dropped
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert unickpt.latest(root) == root + "/step-00000001"
    assert _value(root) == (1.0, 1)
    assert "unickpt.json" not in _objects(root + "/step-00000002")


def test_trainer_saves_to_and_resumes_from_s3_with_retention(s3, uninterrupted_losses):
    from tests.test_trainer import STEPS, _train

    root = s3.bucket("ck-train") + "/run"
    env = _env(s3, "obstore")
    first = dist.run(_train, 2, 2, 1, 3, root, 1, False, "fp32", {"keep": 2, "async_save": True}, env=env)[0][0]
    assert [s for s in _objects(root) if s.endswith("/unickpt.json")] == [
        "step-00000002/unickpt.json", "step-00000003/unickpt.json"]
    resumed = dist.run(_train, 2, 2, 1, STEPS, root, None, True, env=env)[0][0]
    assert first + resumed == uninterrupted_losses  # same strategy: bit-identical losses


def test_a_scheme_whose_fsspec_package_is_missing_names_the_package():
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:  # installed here: the message cannot be about it
        pytest.fail("gcsfs is installed in the test environment; pick another scheme for this test")
    with pytest.raises(StorageError, match="gcsfs"):
        unickpt.latest("gs://bucket/run")


def _direct_io_on_s3(rank, world, url):
    with pytest.raises(UnickptError) as info:
        unickpt.save(build("zero2", reference(), rank, world), url, direct_io=True, timeout_s=600)
    return str(info.value)


def test_an_error_opening_a_writer_fails_every_rank_at_once(s3):
    """direct_io=True cannot be honoured by an object store: a typed error on every rank,
    at once (not after the exchange timeout: 600 s, past the job's 120 s, a hang guard
    only), nothing committed."""
    url = s3.bucket("ck-direct") + "/ck"
    for said in dist.run(_direct_io_on_s3, 2, url, env=_env(s3, "obstore"), timeout=120):
        assert not dist.waited_out(said), said
    assert "unickpt.json" not in _objects(url)


@pytest.mark.parametrize("where", ["memory", "obstore", "s3fs"])
def test_objects_from_positional_writes_in_any_order_read_back_exactly(s3, where, monkeypatch):
    """Parts fill from writes in any order (quantized codes and scales interleave), are
    uploaded when complete (part buffers reused), and read back by ranged reads at any
    offset; writes past the planned size and holes are errors, and nothing appears."""
    import numpy as np

    import unickpt.io.objstore.objects as objstore
    from unickpt.io.storage import storage_for

    monkeypatch.setattr(objstore, "PART", 5 << 20)
    monkeypatch.setattr(objstore, "READ_CHUNK", 3 << 20)
    url = "memory://unickpt-test/objects" if where == "memory" else s3.bucket("ck-objects") + "/" + where
    st, p = storage_for(url, None if where == "memory" else {"client": where})
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(17 << 20) + 12345, dtype=np.uint8)
    cuts = sorted(set(rng.integers(1, len(data), size=40).tolist()) | {0, len(data)})
    pieces = list(zip(cuts, cuts[1:]))
    order = rng.permutation(len(pieces))  # (obstore takes parts in order: finished ones wait for their predecessors)
    for size in (len(data), None):
        name = f"f-{size}"
        w = st.open_writer(st.join(p, name), size=size)
        if size is None:  # unknown size (zstd-framed files): appended in order
            order = range(len(pieces))
        for k in order:
            a, b = pieces[k]
            w.write_at(a, memoryview(data[a:b]))
        w.close()
        r = st.open_reader(st.join(p, name))
        assert r.size == len(data)
        for a, b in [(0, len(data)), (5 << 20, (5 << 20) + 1), (123, (11 << 20) + 7), (len(data) - 9, len(data))]:
            out = np.empty(b - a, dtype=np.uint8)
            r.readinto(a, memoryview(out))
            assert np.array_equal(out, data[a:b]), (name, a, b)
    w = st.open_writer(st.join(p, "past"), size=10)
    with pytest.raises(StorageError, match="planned size"):
        w.write_at(5, memoryview(b"0123456789"))
    w.abort()
    w = st.open_writer(st.join(p, "holes"), size=len(data))
    w.write_at(0, memoryview(data[:1000]))
    with pytest.raises(StorageError, match="holes"):
        w.close()
    assert not st.isfile(st.join(p, "past")) and not st.isfile(st.join(p, "holes"))


def _memory_on_two_ranks(rank, world):
    with pytest.raises(InvalidArgumentError, match="one process"):
        unickpt.save({"w": torch.ones(4)}, "memory://unickpt-test/two")
    unickpt.save({"w": torch.ones(4)}, "memory://unickpt-test/two", group="local")  # each its own
    with pytest.raises(InvalidArgumentError, match="one process"):
        unickpt.load({"w": torch.zeros(4)}, "memory://unickpt-test/two")
    return True


def test_memory_urls_are_refused_where_another_process_would_write():
    with pytest.raises(InvalidArgumentError, match="asynchronous"):
        unickpt.save({"w": torch.ones(4)}, "memory://unickpt-test/async", async_save=True)
    dist.run(_memory_on_two_ranks, 2)


@pytest.mark.parametrize("url", ["s3://", "s3:///x", "memory://", "s3://b//x", "s3://b/../x", "memory://a/./b"])
def test_malformed_urls_are_refused_typed(url, aws_offline):
    with pytest.raises(InvalidArgumentError, match="URL needs a path"):
        unickpt.latest(url)


def test_file_urls_always_take_the_local_path_that_never_follows_links(tmp_path):
    from unickpt.io.local import LocalStorage
    from unickpt.io.storage import storage_for

    assert isinstance(storage_for(f"file://{tmp_path}", {"anything": 1})[0], LocalStorage)


@pytest.mark.parametrize("answer", ["lost", "retried"])
def test_a_commit_whose_answer_is_lost_is_committed_not_deleted(s3, monkeypatch, answer):
    """The manifest put reached the store but its answer did not (or a retry found the
    object and got 412): the write reads the manifest back, finds its own, and is committed;
    nothing it wrote is deleted, and retention keeps it."""
    from unickpt.io.objstore import ObjectStorage

    root = s3.bucket("ck-lost") + "/" + answer
    _save_one(f"{root}/step-00000001", 1, 1.0)
    real = ObjectStorage.put_marker

    def put_then_fail(self, path, data, **kw):
        real(self, path, data, **kw)
        if answer == "lost":
            raise StorageError(104, "connection reset by peer", path)
        raise CheckpointExistsError(f"{path}: precondition failed")

    monkeypatch.setattr(ObjectStorage, "put_marker", put_then_fail)
    _save_one(f"{root}/step-00000002", 2, 2.0)
    monkeypatch.undo()
    assert unickpt.retain(root, 1) == [f"{root}/step-00000001"]
    assert _value(root) == (2.0, 2)


def test_abort_after_commit_deletes_nothing():
    from unickpt.io.commit import Transaction
    from unickpt.io.storage import storage_for

    st, p = storage_for("memory://unickpt-test/abort-after")
    t = Transaction(st, p)
    t.begin()
    st.write_bytes(t.path(t.file_name("model-00001-of-00001.safetensors")), b"x")
    t.commit(b"{}")
    t.abort()  # e.g. a later agreement failed on another rank
    assert sorted(st.listdir(p)) == [t.file_name("model-00001-of-00001.safetensors"), "unickpt.json"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_loser_of_two_writes_never_touches_the_winners_side_files(overwrite):
    from unickpt.io.commit import Transaction
    from unickpt.io.storage import storage_for

    st, p = storage_for(f"memory://unickpt-test/side-{overwrite}")
    if overwrite:
        t0 = Transaction(st, p)
        t0.begin()
        t0.put("config.json", b'{"who": 0}')
        t0.commit(b'{"who": 0}')
    a, b = Transaction(st, p, overwrite=overwrite), Transaction(st, p, overwrite=overwrite)
    a.begin()
    b.begin()
    a.put("config.json", b'{"who": 1}')
    b.put("config.json", b'{"who": 2}')
    a.commit(b'{"who": 1}')
    with pytest.raises(CheckpointExistsError):
        b.commit(b'{"who": 2}')
    b.abort()
    assert st.read_bytes(st.join(p, "config.json"), 100) == b'{"who": 1}'
    assert st.read_bytes(st.join(p, "unickpt.json"), 100) == b'{"who": 1}'


def test_a_sweep_listing_taken_before_a_commit_never_deletes_the_committed_data(monkeypatch):
    """A sweep lists the prefix (no manifest yet), the save commits (manifest put, owner
    record deleted), then the sweep decides, long after the grace periods: the vanished
    record counts as alive and the manifest, read after the records, protects what it lists."""
    import unickpt.io.commit as commit
    from unickpt.io.objstore import ObjectStorage

    url = "memory://unickpt-test/sweep-race"
    snap = {}
    real = ObjectStorage.put_marker

    def snapshot_then_put(self, path, data, **kw):
        snap["objs"] = self.list_objects(url)
        return real(self, path, data, **kw)

    monkeypatch.setattr(ObjectStorage, "put_marker", snapshot_then_put)
    _save_one(url, 1, 1.0)
    monkeypatch.undo()
    assert any(o.key.startswith(".owner-") for o in snap["objs"])
    assert not any(o.key == "unickpt.json" for o in snap["objs"])
    from unickpt.io.storage import storage_for

    st, p = storage_for(url)
    monkeypatch.setattr(type(st), "list_objects", lambda self, path: snap["objs"])
    real_time = time.time
    monkeypatch.setattr(commit.time, "time", lambda: real_time() + 2 * commit.STALE_AFTER)
    assert commit._sweep_prefix(st, p) == []
    monkeypatch.undo()
    assert _value(url) == (1.0, 1)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_missing_bucket_is_an_error_not_an_empty_root(s3, client):
    with pytest.raises(StorageError, match="no-such-bucket-unickpt"):
        unickpt.latest("s3://no-such-bucket-unickpt/run", storage_options={"client": client})


def test_convert_from_dcp_into_s3(s3, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    sd = {"model": {"w": torch.arange(20.0).view(4, 5)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process warning
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"))
    url = s3.bucket("ck-convert") + "/ck"
    r = cli("convert", "--from-dcp", tmp_path / "dcp", url, "-q")
    assert r.returncode == 0, r.stderr
    assert cli("verify", url).returncode == 0
    t = {"model": {"w": torch.zeros(4, 5)}}
    unickpt.load(t, url)
    assert torch.equal(t["model"]["w"], sd["model"]["w"])


def test_wrong_credentials_give_typed_errors_naming_the_url(monkeypatch):
    """A server that checks signatures (moto with auth on): every entry point fails typed,
    naming the URL, with either client."""
    from tests.s3server import S3Server

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # read by the server at start-up
    server = S3Server().start()
    try:
        for k, v in server.env.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        for client in CLIENTS:
            o = {"client": client}
            for call in (lambda: unickpt.latest("s3://anybucket/run", storage_options=o),
                         lambda: unickpt.save({"w": torch.ones(4)}, "s3://anybucket/run/step-1", storage_options=o),
                         lambda: unickpt.load({"w": torch.ones(4)}, "s3://anybucket/run", storage_options=o)):
                with pytest.raises(StorageError, match="anybucket"):
                    call()
    finally:
        server.stop()


# -- no packet leaves the loopback interface --------------------------------------------------------

_NO_DISCOVERY = r"""
import json, os, socket, sys

# Every address this process's Python code connects to or resolves is recorded, and refused
# unless it is on the loopback: nothing leaves the machine even when the test fails.
seen = {"connect": [], "resolve": []}


def _loopback(host):
    return str(host) in ("localhost", "::1") or str(host).startswith("127.")


real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo


def _check(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        seen["connect"].append([str(address[0]), int(address[1])])
        if not _loopback(address[0]):
            raise ConnectionRefusedError(111, f"test: refused a connection to {address[0]} (not loopback)")


def connect(self, address):
    _check(self, address)
    return real_connect(self, address)


def connect_ex(self, address):
    _check(self, address)
    return real_connect_ex(self, address)


def getaddrinfo(host, *a, **k):
    if host is not None:
        seen["resolve"].append(host.decode() if isinstance(host, bytes) else str(host))
        if not _loopback(seen["resolve"][-1]):
            raise socket.gaierror(socket.EAI_NONAME, f"test: refused to resolve {host} (not loopback)")
    return real_getaddrinfo(host, *a, **k)


socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo

import torch  # noqa: E402
import unickpt  # noqa: E402

client, url, out = sys.argv[1:4]
try:
    unickpt.save({"model": {"w": torch.arange(64.0)}}, url, storage_options={"client": client})
    t = {"model": {"w": torch.zeros(64)}}
    unickpt.load(t, url, storage_options={"client": client})
    seen["ok"] = bool(torch.equal(t["model"]["w"], torch.arange(64.0)))
except Exception as e:
    seen["error"] = f"{type(e).__name__}: {e}"[:2000]
with open(out, "w") as f:
    json.dump(seen, f)
"""


def _discovery_env(tmp_path, trap) -> dict:
    """This machine's environment plus everything that sends an AWS client looking for
    credentials, settings or a route of its own: profiles and files (whose credential_process
    leaves a marker file when run), web identity, container credentials, instance metadata,
    another S3 endpoint, proxies, fsspec's s3 arguments. Every endpoint among them is the
    trap (a loopback listener that records connections), so that even a client that used one
    sends nothing off the machine; no credentials, region or endpoint of the tests' own."""
    marker = tmp_path / "credential_process-ran"
    script = tmp_path / "credential_process.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n"
                      "print('{\"Version\": 1, \"AccessKeyId\": \"AKIAFROMPROCESS\", \"SecretAccessKey\": \"x\"}')\n")
    proc = f"{sys.executable} {script}"
    config = tmp_path / "aws-config"
    config.write_text(f"[default]\nregion = eu-west-3\nendpoint_url = {trap.url}\ncredential_process = {proc}\n"
                      f"[profile unickpt-discovery]\nregion = eu-west-3\nendpoint_url = {trap.url}\n"
                      f"credential_process = {proc}\n")
    creds = tmp_path / "aws-credentials"
    creds.write_text("[unickpt-discovery]\naws_access_key_id = AKIAFROMFILE\naws_secret_access_key = x\n")
    token = tmp_path / "web-identity-token"
    token.write_text("not-a-token")
    env = {k: v for k, v in os.environ.items()
           if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION",
                        "AWS_ENDPOINT_URL")}
    env.update({
        "AWS_PROFILE": "unickpt-discovery", "AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(creds),
        "AWS_WEB_IDENTITY_TOKEN_FILE": str(token), "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/unickpt-test",
        "AWS_ROLE_SESSION_NAME": "unickpt-test", "AWS_STS_ENDPOINT": trap.url,
        "AWS_CONTAINER_CREDENTIALS_FULL_URI": trap.url + "/credentials",
        "AWS_EC2_METADATA_DISABLED": "false", "AWS_EC2_METADATA_SERVICE_ENDPOINT": trap.url,
        "AWS_METADATA_ENDPOINT": trap.url, "AWS_ENDPOINT_URL_S3": trap.url, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true",
        "FSSPEC_S3_ENDPOINT_URL": trap.url, "NO_PROXY": "", "no_proxy": "",
        **{k: trap.url for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")},
    })
    return env


def _run_no_discovery(tmp_path, client, url, env) -> dict:
    out = tmp_path / f"seen-{client}-{len(list(tmp_path.iterdir()))}.json"
    r = subprocess.run([sys.executable, "-c", _NO_DISCOVERY, client, url, str(out)], env=env, capture_output=True,
                       text=True, timeout=300)  # a hang guard only
    assert r.returncode == 0 and out.exists(), r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("client", CLIENTS)
def test_no_connection_leaves_this_machine(s3, tmp_path, client):
    """A save and a load with each S3 client, in the tests' environment (tests/s3server.py
    offline_env) applied over one that would send a client looking for credentials, settings
    or another route (_discovery_env): the data go to the loopback server and nowhere else.

    What is covered: every connection and name lookup made by Python code in the process
    (s3fs, aiobotocore, botocore, urllib: socket.socket.connect / connect_ex and
    socket.getaddrinfo, wrapped, and refused off the loopback) must be to 127.0.0.1 / ::1;
    and, for both clients, nothing reaches the trap that stands in for every discovery
    endpoint (instance metadata, STS, container credentials, a configured or S3-specific
    endpoint, proxies), nor runs a profile's credential_process. obstore is Rust
    (object_store): its sockets and lookups are not seen from Python; it is covered through
    its configuration: the only discovery it has (instance metadata, here the trap) is
    skipped because explicit credentials are given, which the control run without them shows
    (test_obstore_without_credentials_would_ask_the_metadata_service). Not covered: a lookup
    or connection made by native code outside those (torch's own sockets, c-ares)."""
    from tests.s3server import ConnectionTrap

    trap = ConnectionTrap()
    try:
        url = s3.bucket("ck-offline") + f"/{client}/ck"
        env = s3.environ({"AWS_METADATA_ENDPOINT": trap.url, "AWS_EC2_METADATA_SERVICE_ENDPOINT": trap.url},
                         base=_discovery_env(tmp_path, trap))
        seen = _run_no_discovery(tmp_path, client, url, env)
    finally:
        trap.close()
    assert seen.get("ok") is True, seen.get("error")
    assert trap.hits == [], trap.hits  # no metadata, credentials, STS, endpoint or proxy asked
    assert not (tmp_path / "credential_process-ran").exists()  # no profile's credential_process run
    away = [a for a in seen["connect"] if not (a[0].startswith("127.") or a[0] == "::1")]
    assert away == [] and all(h in ("127.0.0.1", "localhost", "::1") for h in seen["resolve"]), seen
    if client == "s3fs":  # Python sockets: the wrapped calls saw the client's own traffic
        assert ["127.0.0.1", s3.port] in seen["connect"], seen


def test_obstore_without_credentials_would_ask_the_metadata_service(s3, tmp_path):
    """The control of test_no_connection_leaves_this_machine for obstore: the same run with
    the explicit credentials removed asks instance metadata (here the trap) and fails, so a
    trap that saw nothing there means the credentials given were used."""
    from tests.s3server import ConnectionTrap

    trap = ConnectionTrap()
    try:
        url = s3.bucket("ck-offline") + "/control/ck"
        env = s3.environ({"AWS_METADATA_ENDPOINT": trap.url, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
                          "UNICKPT_OBJECT_TIMEOUT_S": "5"}, base=_discovery_env(tmp_path, trap))
        seen = _run_no_discovery(tmp_path, "obstore", url, env)
    finally:
        trap.close()
    assert "error" in seen and trap.hits, (seen, trap.hits)
