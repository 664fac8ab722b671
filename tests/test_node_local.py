"""Node-local storage: ``{node}`` paths, and loads where ranks cannot read each other's disks.

Nodes are simulated on one machine with ``UNICKPT_NODE_ID``; each node's directory is
``ROOT/<node>/ck``. Every rank process refuses (by a patched file reader) to open anything
outside its own node's directory, so a load can only succeed through the send/recv plan.

Saved on 2 nodes x 2 ranks (TP 2 x ZeRO 2), O0, O1 + residual masters and O2 + dropped
masters (rebuilt from model weights that may sit on the other node); loaded on
4 nodes x 1 rank (two nodes hold nothing), 2 x 1, 2 nodes with 2 + 1 ranks, and on one node
(x 2, x 3) after the node directories were gathered onto it. O0 loads are bit-exact, O1/O2
loads equal the single-process dequantization.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import unickpt
from tests import dist
from tests.layouts import assert_same, build, zeros_like_full
from tests.test_quant_matrix import expected, reference_q

CONFIGS = {"o0": {}, "o1": dict(quant="O1", master="residual"), "o2": dict(quant="O2", master="drop")}


def _as_node(root: str, node: str) -> None:
    """Make this process node ``node``: it may open files only under ROOT/<node>/."""
    import unickpt.io.local as st

    os.environ["UNICKPT_NODE_ID"] = node
    mine = os.path.join(root, node) + os.sep
    orig = st._Reader.__init__

    def guarded(self, path):
        if not os.path.abspath(path).startswith(mine):
            raise AssertionError(f"node {node} opened {path}, on another node's disk")
        orig(self, path)

    st._Reader.__init__ = guarded


def _save(rank, world, root):
    _as_node(root, f"n{rank // 2}")
    ref = reference_q()
    for cfg, kw in CONFIGS.items():
        sd = build("tp2zero2", ref, rank, world)
        sd["step"] = 7
        r = unickpt.save(sd, os.path.join(root, "{node}", f"ck-{cfg}"), step=7, bucket_bytes=4096, **kw)
    return r.files


def _load(rank, world, root, nodes, layout):
    _as_node(root, nodes[rank])
    ref = reference_q()
    out = []
    for cfg, kw in CONFIGS.items():
        path = os.path.join(root, "{node}", f"ck-{cfg}")
        target = build(layout, zeros_like_full(ref), rank, world)
        target["step"] = -1
        res = unickpt.load(target, path, bucket_bytes=2048, verify="full")
        assert target.pop("step") == 7 and res.step == 7
        if cfg == "o0":
            want = ref
        else:
            _, man = unickpt.read_manifest(os.path.join(root, nodes[0], f"ck-{cfg}"))
            dropped = {n for (r, n), t in man.tensors.items() if r == "master" and t.codec == "from_model"}
            want = expected(ref, kw["quant"], dropped, step=7)
        assert_same(target, build(layout, want, rank, world), f"{cfg} -> {layout} on {nodes} (rank {rank})")
        out.append(res.received)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nodes"))
    for n in ("n0", "n1"):
        os.makedirs(os.path.join(root, n))
    dist.run(_save, 4, root)
    return root


def test_each_node_holds_its_own_files_and_a_full_manifest(saved):
    files = {}
    for n in ("n0", "n1"):
        for cfg in CONFIGS:
            d = os.path.join(saved, n, f"ck-{cfg}")
            assert os.path.exists(os.path.join(d, "unickpt.json")), d
            _, man = unickpt.read_manifest(d)
            here = {f for f in os.listdir(d) if f.endswith(".safetensors")}
            assert here == {f for f, e in man.files.items() if e.node == n}, (n, cfg)
            assert here, (n, cfg)
            files.setdefault(cfg, set()).update(here)
            assert files[cfg] <= set(man.files)
    for cfg in CONFIGS:
        assert files[cfg] == set(unickpt.read_manifest(os.path.join(saved, "n0", f"ck-{cfg}"))[1].files)


@pytest.mark.parametrize(
    "nodes,layout",
    [(["n0", "n1", "n2", "n3"], "zero4"), (["n0", "n1"], "tpcol2"), (["n0", "n0", "n1"], "zero3"),
     (["n1", "n0"], "dtensor2")],
    ids=["4x1", "2x1", "2+1", "2x1-swapped"],
)
def test_loads_across_nodes_exchange_pieces(saved, nodes, layout):
    out = dist.run(_load, len(nodes), saved, nodes, layout)
    assert all(any(x) for x in zip(*out)), out  # some rank received pieces, for every config


@pytest.mark.parametrize("world,layout", [(2, "tprow2"), (3, "tpcol3")], ids=["1x2", "1x3"])
def test_one_node_after_gathering_the_files(saved, tmp_path, world, layout):
    root = str(tmp_path)
    for cfg in CONFIGS:
        dst = os.path.join(root, "all", f"ck-{cfg}")
        shutil.copytree(os.path.join(saved, "n0", f"ck-{cfg}"), dst)
        src1 = os.path.join(saved, "n1", f"ck-{cfg}")
        for f in os.listdir(src1):
            if f.endswith(".safetensors"):
                shutil.copy(os.path.join(src1, f), dst)
    out = dist.run(_load, world, root, ["all"] * world, layout)
    assert not any(x for o in out for x in o)  # everything local: no exchange
    if world == 2:  # the offline tools work on the gathered directory (docs/format.md)
        from tests.clirun import cli

        ck = os.path.join(root, "all", "ck-o1")
        assert cli("verify", ck).returncode == 0
        assert cli("reshard", ck, os.path.join(root, "re"), "--drop-role", "optimizer", "-q").returncode == 0


def _load_missing(rank, world, root):
    _as_node(root, f"n{rank}")
    target = build("zero2", zeros_like_full(reference_q()), rank, world)
    try:
        unickpt.load(target, os.path.join(root, "{node}", "ck-o0"))
    except unickpt.errors.UnickptError as e:
        return str(e)
    return None


def test_a_file_no_rank_can_see_is_named(saved, tmp_path):
    root = str(tmp_path)
    shutil.copytree(os.path.join(saved, "n0"), os.path.join(root, "n0"))
    os.makedirs(os.path.join(root, "n1"))  # node n1 lost its disk
    msgs = dist.run(_load_missing, 2, root)
    assert all(m and "cannot be read by any rank" in m and "n1" in m for m in msgs), msgs


def _train_on_nodes(rank, world, root, nodes, stage, tp, steps, save_at, resume):
    from tests.test_trainer import _train

    _as_node(root, nodes[rank])
    return _train(rank, world, stage, tp, steps, os.path.join(root, "{node}", "run"), save_at, resume)[0]


def test_trainer_resumes_from_node_local_checkpoints(tmp_path):
    """ZeRO-2 on 2 nodes x 2 ranks stops at step 3; TP 2 x ZeRO-1 on 4 nodes x 1 rank (two of
    them without any file) resumes and matches the uninterrupted run."""
    from tests.test_trainer import STEPS, STOP, _close, _train

    root = str(tmp_path)
    for n in ("n0", "n1", "n2", "n3"):
        os.makedirs(os.path.join(root, n))
    first = dist.run(_train_on_nodes, 4, root, ["n0", "n0", "n1", "n1"], 2, 1, STOP, STOP, False)[0]
    assert sorted(os.listdir(os.path.join(root, "n1", "run"))) == [f"step-{STOP:08d}"]
    rest = dist.run(_train_on_nodes, 4, root, ["n0", "n1", "n2", "n3"], 1, 2, 6, None, True)[0]
    full = dist.run(_train, 4, 2, 1, STEPS)[0][0]
    _close(first + rest, full)


def test_remote_chunks_are_cut_only_where_checksummed_ranges_start():
    from unickpt.layout import Layout
    from unickpt.remote import _chunks

    full = Layout.full((1000,))
    bounds = np.array([0, 300, 600])
    assert _chunks(full, bounds, 4, 400) == [(0, 300), (300, 600), (600, 1000)]  # ranges stay whole
    assert _chunks(full, bounds, 4, 2400) == [(0, 600), (600, 1000)]
    assert _chunks(full, bounds, 4, 1 << 20) == [(0, 1000)]
    col = Layout((10, 100), (0, 50), (10, 50))  # column block: boundary 300 = row 3, col 0 -> local 150
    assert _chunks(col, bounds, 4, 400) == [(0, 150), (150, 300), (300, 500)]


def _load_corrupt(rank, world, root, verify_of=None):
    from tests.layouts import full

    _as_node(root, f"n{rank}")
    target = full(zeros_like_full(reference_q()), rank, world)  # every rank reads every tensor whole
    try:
        unickpt.load(target, os.path.join(root, "{node}", "ck-o0"), bucket_bytes=4096,
                     verify=(verify_of or {}).get(rank, "auto"))
    except unickpt.errors.UnickptError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_a_corrupted_byte_on_another_node_is_detected(saved, tmp_path):
    """The rank that reads for a peer verifies what it sends: a flipped byte in node n1's
    file fails the load on every rank (verify="auto"; ranks on n0 and n2 get n1's tensors
    from the rank on n1)."""
    root = str(tmp_path)
    for n in ("n0", "n1"):
        shutil.copytree(os.path.join(saved, n), os.path.join(root, n))
    _, man = unickpt.read_manifest(os.path.join(root, "n1", "ck-o0"))
    t = next(t for t in man.tensors.values() if man.files[t.file].node == "n1" and t.nbytes > 64)
    with open(os.path.join(root, "n1", "ck-o0", t.file), "r+b") as f:
        f.seek(man.files[t.file].data_start + t.begin + 17)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    msgs = dist.run(_load_corrupt, 3, root)
    assert all(m and "checksum" in m.lower() for m in msgs), msgs
    assert any(t.name in m for m in msgs), (t.name, msgs)
    # verify is per rank: the rank on n1 opting out still checks what it reads for the others
    msgs = dist.run(_load_corrupt, 3, root, {1: "none"})
    assert msgs[0] and msgs[2] and "checksum" in msgs[0].lower() and t.name in msgs[0] + msgs[2], msgs


@pytest.mark.parametrize("damage", ["bit flip", "fifo", "another save's"])
def test_every_node_checks_its_own_copy_of_the_manifest(saved, tmp_path, damage):
    """Rank 0 shares its node's manifest; a damaged or foreign copy on node n1 is refused on
    every rank, naming n1's file (n2 holds no copy and follows)."""
    root = str(tmp_path)
    for n in ("n0", "n1"):
        shutil.copytree(os.path.join(saved, n), os.path.join(root, n))
    m = os.path.join(root, "n1", "ck-o0", "unickpt.json")
    if damage == "bit flip":
        data = bytearray(open(m, "rb").read())
        data[len(data) // 2] ^= 4
        open(m, "wb").write(bytes(data))
    elif damage == "fifo":
        os.remove(m)
        os.mkfifo(m)
    else:
        shutil.copy(os.path.join(root, "n1", "ck-o1", "unickpt.json"), m)
    msgs = dist.run(_load_corrupt, 3, root)
    assert all(msgs), msgs
    assert any("n1" in x and ("differs" in x or "damaged" in x or "FIFO" in x) for x in msgs), msgs


def _save_extra_files(rank, world, root):
    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"
    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    given = {0: {"config.json": '{"from": "rank 0"}'}, 1: {"config.json": '{"from": "rank 1"}'}, 2: None}[rank]
    unickpt.save(sd, os.path.join(root, "{node}", "ck"), step=1, extra_files=given)


def test_every_node_gets_rank_0s_extra_files(tmp_path):
    """The manifest (the same on every node) records rank 0's extra files; each node's first
    rank wrote its own, so a node given other text, or none, held files that fail their
    checks (a committed checkpoint that `unickpt verify` refused on that node)."""
    import xxhash

    root = str(tmp_path)
    dist.run(_save_extra_files, 3, root)
    for n in ("n0", "n1", "n2"):
        d = os.path.join(root, n, "ck")
        data = open(os.path.join(d, "config.json"), "rb").read()
        assert data == b'{"from": "rank 0"}', (n, data)
        size, digest = unickpt.read_manifest(d)[1].aux["config.json"]
        assert (size, digest) == (len(data), xxhash.xxh3_64_hexdigest(data)), n


def test_cli_verify_checks_one_nodes_directory(saved, tmp_path):
    """`unickpt verify` of one node's directory failed on every node: the other nodes' files
    are missing there by design. With --node it checks the files that directory holds and
    names the rest; without, it says why the files are missing."""
    from tests.clirun import cli

    for n, other in (("n0", "n1"), ("n1", "n0")):
        d = os.path.join(saved, n, "ck-o1")
        man = unickpt.read_manifest(d)[1]
        mine = sorted(f for f, e in man.files.items() if e.node == n)
        r = cli("verify", d, "--node", n, "--json", "-q")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["node"] == n and out["files"] == len(mine) and out["bad"] == []
        assert out["elsewhere"] == sorted(f for f, e in man.files.items() if e.node == other)
        assert out["tensors"] == sum(man.files[t.file].node == n for t in man.tensors.values())
        r = cli("verify", d)
        assert r.returncode == 1 and f"written on node(s) ['{other}']" in r.stderr and "--node ID" in r.stderr, r.stderr
        r = cli("verify", d, "--node", other)  # the wrong node: its files are not here
        assert r.returncode == 1 and f"is missing (written on node {other}" in r.stderr, r.stderr
    assert cli("verify", os.path.join(saved, "n0", "ck-o1"), "--node", "n9").returncode == 2
    # a damaged file of the node is still found
    d = os.path.join(saved, "n1")
    bad = str(tmp_path / "n1")
    shutil.copytree(d, bad)
    f = sorted(f for f, e in unickpt.read_manifest(os.path.join(bad, "ck-o0"))[1].files.items() if e.node == "n1")[0]
    with open(os.path.join(bad, "ck-o0", f), "r+b") as fh:
        fh.seek(-3, 2)
        b = fh.read(1)
        fh.seek(-3, 2)
        fh.write(bytes([b[0] ^ 0xFF]))
    r = cli("verify", os.path.join(bad, "ck-o0"), "--node", "n1")
    assert r.returncode == 1 and "do not match their checksum" in r.stderr, r.stderr
