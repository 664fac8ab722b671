"""Failures on one rank surface on every rank, and nothing becomes visible."""

import os

import torch

import unickpt
from tests import dist
from unickpt.errors import DistributedError, LayoutError, ShapeMismatchError, UnickptError


def _bad_target_on_one_rank(rank, world, root):
    unickpt.save({"model": {"w": unickpt.shard(torch.full((2, 4), float(rank)), (4, 4), offsets=(2 * rank, 0))}}, root)
    rows = 3 if rank == 1 else 4  # rank 1 believes in another shape
    t = {"model": {"w": torch.zeros(rows, 4)}}
    try:
        unickpt.load(t, root)
    except UnickptError as e:
        return type(e).__name__, str(e), float(t["model"]["w"].abs().sum())
    return None


def test_bad_target_on_one_rank_raises_everywhere_without_filling(tmp_path):
    out = dist.run(_bad_target_on_one_rank, 2, str(tmp_path / "ck"))
    assert out[1][0] == ShapeMismatchError.__name__
    assert out[0][0] == DistributedError.__name__ and "rank 1" in out[0][1] and "tensor 'w'" in out[0][1]
    assert out[0][2] == 0 and out[1][2] == 0


def _refused_on_one_rank(rank, world, root, case):
    """A load that one rank's target refuses (a missing value; unexpected tensors under
    ``unexpected="error"`` on that rank alone): the refusal travels in the validation's one
    all-reduce, and every rank raises before any byte is read."""
    import json

    sd = {"model": {"w": unickpt.shard(torch.ones(2, 4), (4, 4), offsets=(2 * rank, 0)), "v": torch.ones(3)}}
    if case == "node manifest":
        os.environ["UNICKPT_NODE_ID"] = f"n{rank}"
        root = os.path.join(root, "{node}")
    unickpt.save(sd, root, step=3)
    t = {"model": {"w": torch.zeros(4, 4)}}
    kw = {}
    if case == "missing" and rank == 1:
        t["model"]["x"] = torch.zeros(2)
    if case == "unexpected":
        kw = {"unexpected": "error" if rank == 0 else "ignore"}
    if case == "node manifest":
        t["model"]["v"] = torch.zeros(3)
        if rank == 1:  # this node's copy says another step: not the manifest rank 0 shares
            mine = os.path.join(root.replace("{node}", "n1"), "unickpt.json")
            with open(mine) as f:
                m = json.load(f)
            m["extra"] = {"tampered": True}
            with open(mine, "w") as f:
                json.dump(m, f)
    try:
        unickpt.load(t, root, **kw)
    except UnickptError as e:
        return type(e).__name__, str(e), float(t["model"]["w"].abs().sum())
    return None


def test_a_target_refused_on_one_rank_raises_everywhere_before_reading(tmp_path):
    for case, refuses, cls, said in (("missing", 1, "TensorMissingError", "'x'"),
                                     ("unexpected", 0, "UnexpectedTensorError", "model/v"),
                                     ("node manifest", 1, "FormatError", "manifest differs")):
        out = dist.run(_refused_on_one_rank, 2, str(tmp_path / case.replace(" ", "-")), case)
        assert out[refuses][0] == cls and said in out[refuses][1], (case, out)
        other = out[1 - refuses]
        assert other[0] == DistributedError.__name__ and f"failed on rank {refuses}" in other[1], (case, out)
        assert said in other[1], (case, out)
        assert out[0][2] == 0 and out[1][2] == 0, (case, out)  # nothing was written into a target


def _manifest_differs_with_objects(rank, world, root):
    """A node's manifest differs: no rank may start matching its target (stateful objects'
    own code: an optimizer's state would be created; a state_dict() may make collectives)."""
    import glob
    import json

    import torch.distributed as tdist

    from tests.crafted import seal

    class Collective:  # a Stateful whose state_dict makes a collective of its own
        def state_dict(self):
            tdist.all_gather_object([None] * world, rank)
            return {"x": torch.zeros(2)}

        def load_state_dict(self, sd):
            pass

    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"
    root = os.path.join(root, "{node}")
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    unickpt.save({"model": m, "optim": opt, "extra": Collective()}, root, step=3)
    tdist.barrier()
    if rank == 1:
        mine = glob.glob(os.path.join(root.replace("{node}", "n1"), "**", "unickpt.json"), recursive=True)[0]
        with open(mine) as f:
            man = json.load(f)
        man["extra"] = {"tampered": True}
        with open(mine, "wb") as f:
            f.write(seal(man))
    tdist.barrier()
    m2 = torch.nn.Linear(4, 4)
    o2 = torch.optim.AdamW(m2.parameters())
    try:
        unickpt.load({"model": m2, "optim": o2, "extra": Collective()}, root)
        said = None
    except UnickptError as e:
        said = type(e).__name__
    return said, len(o2.state)


def test_a_node_manifest_that_differs_stops_every_rank_before_any_stateful_code(tmp_path):
    out = dist.run(_manifest_differs_with_objects, 2, str(tmp_path), env={"UNICKPT_TIMEOUT_S": "60"})
    assert out[1][0] == "FormatError" and out[0][0] == DistributedError.__name__, out
    assert out[0][1] == 0 and out[1][1] == 0, out  # no rank's fresh optimizer got state


def _first_node_manifest_damaged(rank, world, root):
    import glob

    import torch.distributed as tdist

    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"
    root = os.path.join(root, "{node}")
    unickpt.save({"model": {"w": unickpt.shard(torch.ones(2, 4), (4, 4), offsets=(2 * rank, 0))}}, root, step=3)
    tdist.barrier()
    if rank == 0:  # the copy every rank is sent (rank 0 found it first) no longer matches its seal
        mine = glob.glob(os.path.join(root.replace("{node}", "n0"), "**", "unickpt.json"), recursive=True)[0]
        with open(mine, "r+b") as f:
            text = f.read().replace(b'"step":3', b'"step":4')
            f.seek(0)
            f.write(text)
    tdist.barrier()
    try:
        unickpt.load({"model": {"w": torch.zeros(4, 4)}}, root)
    except UnickptError as e:
        return type(e).__name__, str(e)
    return None


def test_a_damaged_manifest_sent_by_another_node_is_not_blamed_on_this_nodes_file(tmp_path):
    out = dist.run(_first_node_manifest_damaged, 2, str(tmp_path))
    assert out[0][0] == out[1][0] == "FormatError", out
    assert "/n0/" in out[0][1], out
    assert "/n1/" not in out[1][1] and "rank 0 read on its node" in out[1][1], out


def _overlapping(rank, world, root):
    w = unickpt.shard(torch.ones(3, 4), (4, 4), offsets=(rank, 0))  # rows 0-2 and 1-3 overlap
    try:
        unickpt.save({"model": {"w": w}}, root)
    except LayoutError as e:
        return str(e)
    return None


def test_overlapping_shards_refused_on_every_rank(tmp_path):
    out = dist.run(_overlapping, 2, str(tmp_path / "ck"))
    assert all(o and "overlap" in o and "'w'" in o for o in out)
    assert not os.path.exists(tmp_path / "ck")


def _writer_dies(rank, world, root):
    import unickpt.io.local as st

    sd = {"model": {f"t{i}": unickpt.shard(torch.full((64, 64), float(i)), (128, 64), offsets=(64 * rank, 0)) for i in range(6)}}
    unickpt.save(sd, os.path.join(root, "step-00000001"), step=1)
    if rank == 1:
        real = st.LocalStorage.open_writer

        def failing(self, path, direct=None, size=None):
            w = real(self, path, direct=direct, size=size)
            orig = w.write_at

            def write(offset, data, _n=[0]):
                _n[0] += 1
                if _n[0] == 3:
                    raise OSError(28, "No space left on device (injected)")
                return orig(offset, data)

            w.write_at = write
            return w

        st.LocalStorage.open_writer = failing
    try:
        unickpt.save(sd, os.path.join(root, "step-00000002"), step=2, bucket_bytes=8192)
    except (UnickptError, OSError) as e:
        err = f"{type(e).__name__}: {e}"
    else:
        err = None
    return err, unickpt.latest(root)


def test_write_failure_on_one_rank_commits_nothing(tmp_path):
    root = str(tmp_path)
    out = dist.run(_writer_dies, 2, root)
    assert "No space left" in out[1][0]
    assert "DistributedError" in out[0][0] and "rank 1" in out[0][0]
    for _, latest in out:
        assert latest.endswith("step-00000001")
    assert sorted(os.listdir(root)) == ["step-00000001"]  # temporary swept, nothing half-visible
    t = {"model": {f"t{i}": torch.zeros(128, 64) for i in range(6)}}
    assert unickpt.load(t, root).step == 1
    assert torch.equal(t["model"]["t3"], torch.full((128, 64), 3.0))


def _progress_raises(rank, world, root):
    def cb(done, total):
        if rank == 1:
            raise RuntimeError("callback bug")

    sd = {"model": {f"t{i}": unickpt.shard(torch.full((300, 64), float(i)), (600, 64), offsets=(300 * rank, 0)) for i in range(3)}}
    return unickpt.save(sd, root, bucket_bytes=8192, progress=cb).bytes


def test_a_failing_progress_callback_does_not_stall_or_fail_the_save(tmp_path):
    out = dist.run(_progress_raises, 2, str(tmp_path / "ck"), timeout=120)
    assert out[0] == out[1] > 0


def _cache_divergence(rank, world, root):
    import torch.distributed as tdist

    solo = tdist.new_group([0])  # collective: every rank creates it
    sd = {"model": {"w": unickpt.shard(torch.full((4, 8), float(rank)), (8, 8), offsets=(4 * rank, 0))}}
    unickpt.save(sd, os.path.join(root, "a"))  # plan cached on both ranks
    if rank == 0:  # rank 0 alone saves over its own group: evicts the WORLD plan from its cache
        for i in range(5):
            unickpt.save({"model": {f"x{i}": torch.ones(i + 1)}}, os.path.join(root, f"solo{i}"), group=solo)
    unickpt.save(sd, os.path.join(root, "b"))  # rank 1 still has the plan cached; rank 0 does not
    return True


def test_plan_cache_divergence_between_ranks_does_not_hang(tmp_path):
    assert dist.run(_cache_divergence, 2, str(tmp_path), timeout=120) == [True, True]


def _async_bad_state_on_one_rank(rank, world, root):
    from unickpt.errors import StateDictError

    sd = {"model": {"w": unickpt.shard(torch.ones(4, 8), (8, 8), offsets=(4 * rank, 0))}}
    unickpt.save(sd, os.path.join(root, "step-00000001"), step=1, async_save=True).wait(timeout=120)
    bad = dict(sd, junk=object()) if rank == 1 else sd
    try:
        unickpt.save(bad, os.path.join(root, "step-00000002"), step=2, async_save=True).wait(timeout=120)
    except (StateDictError, DistributedError) as e:
        err = type(e).__name__, str(e)
    else:
        err = None, ""
    unickpt.save(sd, os.path.join(root, "step-00000003"), step=3, async_save=True).wait(timeout=120)
    return err


def test_async_bad_state_on_one_rank_raises_everywhere_at_once(tmp_path):
    """Rank 1's state is refused; rank 0 is told at once, by rank 1 (not after the 600 s
    exchange timeout, nor the wait's own 120 s limit, an AsyncSaveError the test would not
    catch; the job's 240 s are a hang guard only)."""
    out = dist.run(_async_bad_state_on_one_rank, 2, str(tmp_path), timeout=240)
    assert out[1][0] == "StateDictError" and out[0][0] == "DistributedError", out
    assert "rank 1" in out[0][1] and not dist.waited_out(out[0][1]), out[0][1]
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-00000001", "step-00000003"]


def _bad_dtype_with_compression(rank, world, root, master):
    x = torch.ones(4, 4, dtype=torch.complex64 if rank == 1 else torch.bfloat16)  # unsupported on rank 1
    sd = {"model": {"w": x}, "master": {"w": torch.ones(4, 4)}}
    try:
        unickpt.save(sd, root, master=master, quant="O1")
    except UnickptError as e:
        return type(e).__name__
    return None


def test_a_bad_state_on_one_rank_under_compression_raises_everywhere(tmp_path):
    """The compression step's collectives stay paired when one rank's state is refused."""
    for master in ("residual", "drop"):
        out = dist.run(_bad_dtype_with_compression, 2, str(tmp_path / master), master, timeout=60)
        assert out[1] == "FormatError" and out[0] in ("DistributedError", "StateDictError"), out
        assert not os.path.exists(tmp_path / master)


def _different_calls(rank, world, root):
    from unickpt.transport import Comm

    sd = {"model": {"w": unickpt.shard(torch.full((2, 4), float(rank)), (4, 4), offsets=(2 * rank, 0))}}
    unickpt.save(sd, os.path.join(root, "a"))
    try:  # rank 0 saves while rank 1 loads: they must not take each other's bytes
        if rank == 0:
            unickpt.save(sd, os.path.join(root, "b"))
        else:
            unickpt.load({"model": {"w": torch.zeros(4, 4)}}, os.path.join(root, "a"))
        said = None
    except DistributedError as e:
        said = str(e)
    c = Comm(timeout_s=600)
    calls = {"broadcast": lambda w: c.broadcast_bytes(b"x" if rank == 0 else None, what=w),
             "all_reduce": lambda w: c.min_max(torch.tensor([1, 2]), what=w),
             "all_gather": lambda w: c.all_gather_bytes(b"y" * 10, what=w)}
    said2 = []
    for mine, theirs in (("broadcast", "broadcast"), ("all_reduce", "all_reduce"), ("broadcast", "all_reduce"),
                         ("all_gather", "broadcast"), ("all_reduce", "all_gather")):
        try:  # the same step in calls of different kinds, or different steps: told apart
            calls[mine if rank == 0 else theirs](f"step {rank}" if mine == theirs else "step")
            said2.append(None)
        except DistributedError as e:
            said2.append((mine, theirs, str(e)))
    try:  # an all-reduce of unequal lengths (gloo would abort the process)
        c.min_max(torch.arange(2 + rank), what="lengths")
        said2.append(None)
    except DistributedError as e:
        said2.append(("lengths", "", str(e)))
    said3 = {}
    for name, kw in (("path", {"path": os.path.join(root, f"p{rank}")}), ("step", {"step": rank}),
                     ("overwrite", {"overwrite": rank == 0})):
        try:  # the same call with different arguments: nothing saved, every rank told which differ
            unickpt.save(sd, **{"path": os.path.join(root, "a"), **kw})
            said3[name] = None
        except DistributedError as e:
            said3[name] = str(e)
    try:
        unickpt.load({"model": {"w": torch.zeros(4, 4)}}, os.path.join(root, "a" if rank == 0 else "c-none"))
        said3["load path"] = None
    except DistributedError as e:
        said3["load path"] = str(e)
    said2.append(said3)
    # per rank by design: rank 0's extra and files are stored, direct_io is each rank's; one
    # directory however spelled
    unickpt.save(sd, os.path.join(root, "d") + ("/" if rank else ""), extra={"rank": rank},
                 extra_files={"notes.txt": "rank 0's"} if rank == 0 else None, direct_io=rank == 0)
    # every rank made the same collectives: the group still works
    unickpt.save(sd, os.path.join(root, "c"))
    assert c.broadcast_bytes(b"ok" if rank == 0 else None, what="after") == b"ok"
    return said, said2, sorted(os.listdir(root))


def test_ranks_in_different_calls_fail_at_once_and_the_group_still_works(tmp_path):
    """Each collective carries a tag of its call: ranks that reached different calls raise
    DistributedError naming each rank's call at once (600 s timeout; the job is killed at
    120 s), rather than taking each other's bytes for their own, also between collectives of
    different kinds (gloo aborts a process whose peer sends a message of another size)."""
    # at once: the 600 s timeout is past the job's 120 s (a hang guard only), so every answer
    # below came from the tags, never from a rank waiting out a timeout
    out = dist.run(_different_calls, 2, str(tmp_path), timeout=120, env={"UNICKPT_TIMEOUT_S": "600"})
    for said, said2, names in out:
        assert said is not None and "different collective calls" in said, said
        assert "rank(s) [0] in 'save (checking the options) [all_gather]'" in said, said
        assert "rank(s) [1] in 'load (the manifest) [broadcast]'" in said, said
        said3 = said2.pop()
        for name, s3 in said3.items():
            assert s3 is not None and "called with different arguments" in s3, (name, s3)
        assert "rank(s) [0]: {\"path\": " in said3["path"] and "p1" in said3["path"], said3["path"]
        assert '{"step": 0}' in said3["step"] and '{"step": 1}' in said3["step"], said3["step"]
        assert '{"overwrite": true}' in said3["overwrite"], said3["overwrite"]
        assert "c-none" in said3["load path"], said3["load path"]
        assert None not in said2, said2
        for mine, theirs, s2 in said2[:-1]:
            if mine == theirs:
                assert f"'step 0 [{mine}]'" in s2 and f"'step 1 [{theirs}]'" in s2, s2
            else:
                assert f"rank(s) [0] in 'step [{mine}]'" in s2 and f"rank(s) [1] in 'step [{theirs}]'" in s2, s2
        assert "different numbers of values ([2, 3])" in said2[-1][2], said2[-1]
        assert names == ["a", "c", "d"]  # b, p0, p1 never committed
