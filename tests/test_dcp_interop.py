"""torch.distributed.checkpoint interop (unickpt.dcp): DCP's own save/load, with DCP's default
planners, writing and reading unickpt checkpoints; FSDP2 resharding on real gloo ranks; the
trust rule (every byte verified) through DCP; `convert --from-dcp` keeping non-tensor state."""

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch

import unickpt
import unickpt.dcp as udcp
from tests import dist
from tests.hf_models import LLAMA, fsdp, llama

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train(model, opt, steps=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _full(model, opt):
    """Full (unsharded, CPU) model and optimizer state, copied (the optimizer's step tensors
    are shared with it): collective; rank 0 gets it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _copy({"model": msd, "optim": osd})


def _copy(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v) for v in state)
    return state


def _same(got, want, where=""):
    """Bit-exact comparison of nested state (DTensors gathered, in the same order on every rank);
    returns the paths that differ."""
    if hasattr(got, "full_tensor"):
        got = got.full_tensor()
    if hasattr(want, "full_tensor"):
        want = want.full_tensor()
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got.cpu(), want)
        return [] if ok else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [where + " (keys)"]
        return [p for k in want for p in _same(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [where + " (length)"]
        return [p for i, (a, b) in enumerate(zip(got, want)) for p in _same(a, b, f"{where}.{i}")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def _zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return None if not isinstance(state, (int, float, str, bool)) else type(state)()


# -- 2 ranks: DCP saves through the writer; unickpt saves for the readers ---------------------


def _save_on_two_ranks(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fsdp(llama(0), world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    _train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    res = dcp.save({"model": msd, "optim": osd, "trainer": {"tokens": 16, "name": "run"}},
                   storage_writer=udcp.StorageWriter(os.path.join(root, "dcp", "step-00000001"), step=1))
    ref1 = _full(model, opt)
    _train(model, opt, 1, seed=1)
    msd, osd = get_state_dict(model, opt)
    dcp.async_save({"model": msd, "optim": osd},
                   storage_writer=udcp.StorageWriter(os.path.join(root, "async"), step=2)).result()
    unickpt.save({"model": msd, "optim": osd}, os.path.join(root, "uni"), step=2)
    unickpt.save({"model": msd, "optim": osd}, os.path.join(root, "uni-o1"), quant="O1", zstd=3)
    ref2 = _full(model, opt)
    # a value that is neither a tensor nor JSON: refused on every rank, nothing committed
    try:
        dcp.save({"model": msd, "junk": {"fn": object()}}, storage_writer=udcp.StorageWriter(os.path.join(root, "bad")))
        refused = "saved"
    except CheckpointException as e:
        refused = " | ".join(f"{type(exc).__name__}: {exc}" for exc, _ in e.failures.values())
    if rank == 0:
        torch.save({"ref1": ref1, "ref2": ref2}, os.path.join(root, "ref.pt"))
    return refused, type(res).__name__


def _load_on_four_ranks(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    refs = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    model = fsdp(llama(1), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    _train(model, opt, 1, seed=7)  # optimizer state exists, with other values

    out = {}
    for name, path, want in (("unickpt.save", "uni", refs["ref2"]), ("StorageWriter", "dcp", refs["ref1"])):
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, storage_reader=udcp.StorageReader(os.path.join(root, path)))
        out[name] = _same({"model": msd, "optim": osd}, want)
    # a compressed checkpoint, resharded 2 -> 4: the reader gives what unickpt.load gives
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=udcp.StorageReader(os.path.join(root, "uni-o1")))
    m2, o2 = get_state_dict(model, opt)
    m2 = {k: torch.zeros_like(v) for k, v in m2.items()}
    unickpt.load({"model": m2, "optim": o2}, os.path.join(root, "uni-o1"))
    out["O1"] = _same({"model": msd, "optim": osd}, {"model": m2, "optim": o2})
    moments = _same(osd["state"], refs["ref2"]["optim"]["state"])
    out["O1 quantized"] = bool(moments) and all("exp_avg" in p for p in moments)  # lossy, only the moments
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    out = dist.run(_save_on_two_ranks, 2, root)
    return root, out, torch.load(os.path.join(root, "ref.pt"), weights_only=True)


def test_dcp_save_with_the_writer_on_two_fsdp2_ranks_is_a_unickpt_checkpoint(saved):
    from safetensors import safe_open

    root, out, refs = saved
    assert [o[1] for o in out] == ["Metadata", "Metadata"]
    path = os.path.join(root, "dcp", "step-00000001")
    assert not os.path.exists(os.path.join(path, ".metadata"))  # no pickle
    ref = refs["ref1"]
    target = _zeros_like({**ref, "trainer": {"tokens": 0, "name": ""}})
    res = unickpt.load(target, os.path.join(root, "dcp"))  # newest step-*, one process
    assert res.step == 1
    assert _same(target, {**ref, "trainer": {"tokens": 16, "name": "run"}}) == []
    assert target["optim"]["param_groups"][0]["lr"] == 3e-3
    # plain safetensors files, whole tensors under the natural names
    _, man = unickpt.read_manifest(path)
    seen = 0
    for fname in man.files:
        with safe_open(os.path.join(path, fname), "pt") as f:
            for k in f.keys():
                role = man.files[fname].role
                want = ref["model"][k] if role == "model" else None
                if role == "optim":
                    fqn, leaf = k[len("state."):].rsplit(".", 1)
                    want = ref["optim"]["state"][fqn][leaf]
                assert torch.equal(f.get_tensor(k), want), k
                seen += 1
    assert seen == len(man.tensors) == len(ref["model"]) + 3 * len(ref["optim"]["state"])
    r = subprocess.run([sys.executable, "-m", "unickpt.cli", "verify", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dcp_async_save_with_the_writer_commits_the_state_it_staged(saved):
    root, _, refs = saved
    target = _zeros_like(refs["ref2"])
    assert unickpt.load(target, os.path.join(root, "async")).step == 2
    assert _same(target, refs["ref2"]) == []


def test_a_value_neither_tensor_nor_json_is_refused_on_every_rank_and_nothing_is_written(saved):
    root, out, _ = saved
    for refused, _ in out:
        assert "StateDictError" in refused and "'junk.fn' holds a object" in refused, refused
    assert not os.path.exists(os.path.join(root, "bad"))
    assert not [n for n in os.listdir(root) if n.startswith(".bad")]


def test_unickpt_save_loads_through_dcp_on_one_plain_process_bit_exact(saved):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, _, refs = saved
    model = llama(2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    _train(model, opt, 1, seed=3)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=udcp.StorageReader(os.path.join(root, "uni")))
    assert _same({"model": msd, "optim": osd}, refs["ref2"]) == []
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == 0.1
    assert type(opt.param_groups[0]["betas"]) is tuple  # as DCP's own reader gives it (JSON stores a list)
    assert int(next(iter(opt.state.values()))["step"]) == 2


def test_unickpt_and_writer_checkpoints_load_through_dcp_resharded_to_four_fsdp2_ranks(saved):
    root, _, _ = saved
    for out in dist.run(_load_on_four_ranks, 4, root):
        assert out["unickpt.save"] == [] and out["StorageWriter"] == [], out
        assert out["O1"] == [] and out["O1 quantized"], out


# -- one process: compressed checkpoints, damage, conversion -----------------------------------


def _mixed_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    master = {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g)}
    return {
        "model": {k: v.bfloat16() for k, v in master.items()},
        "master": master,
        "optimizer": {"exp_avg": {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in master.items()},
                      "exp_avg_sq": {k: torch.rand(v.shape, generator=g) * 1e-6 for k, v in master.items()}},
        "step": 5,
    }


def test_a_compressed_checkpoint_through_the_reader_equals_unickpt_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = _mixed_state()
    unickpt.save(state, tmp_path / "c", quant="O1", master="residual", zstd=3)
    _, man = unickpt.read_manifest(tmp_path / "c")
    codecs = {t.codec for t in man.tensors.values()}
    assert {"q8_sym", "q8_logw", "residual16"} <= codecs and any(f.container == "zstd" for f in man.files.values())
    via_unickpt, via_dcp = _zeros_like(state), _zeros_like(state)
    unickpt.load(via_unickpt, tmp_path / "c")
    dcp.load(via_dcp, storage_reader=udcp.StorageReader(tmp_path / "c"))
    assert _same(via_dcp, via_unickpt) == [] and via_dcp["step"] == 5
    assert torch.equal(via_dcp["master"]["w"], state["master"]["w"])  # residual masters are bit-exact


def test_the_reader_gives_tuples_back_where_the_target_holds_them_as_dcp_does(tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = {"w": torch.ones(1), "meta": {"pairs": [(1, 2), (3, 4)], "nest": ((1, 2), [3]), "betas": (0.9, 0.99)}}
    unickpt.save(saved, tmp_path / "c")
    t = {"w": torch.zeros(1), "meta": {"pairs": [(0, 0), (0, 0)], "nest": ((0, 0), [0]), "betas": (0.0, 0.0)}}
    dcp.load(t, storage_reader=udcp.StorageReader(tmp_path / "c"))
    assert t["meta"] == saved["meta"] and type(t["meta"]["pairs"][0]) is tuple and type(t["meta"]["nest"][1]) is list


def test_a_damaged_byte_fails_the_dcp_load_naming_the_tensor_and_file(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = _mixed_state()
    unickpt.save(state, tmp_path / "c")
    _, man = unickpt.read_manifest(tmp_path / "c")
    st = man.tensors[("optimizer", "exp_avg.w")]
    with open(tmp_path / "c" / st.file, "r+b") as f:
        f.seek(man.files[st.file].data_start + st.begin + 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(_zeros_like(state), storage_reader=udcp.StorageReader(tmp_path / "c"))
    err = ei.value.failures[0][0]
    assert isinstance(err, unickpt.errors.ChecksumError) and err.bad == [(st.file, "exp_avg.w")]
    shown = str(ei.value)  # what the user sees: the typed error, the tensor, the file, what to do
    assert "ChecksumError" in shown and "'exp_avg.w'" in shown and st.file in shown and "damaged" in shown
    target = _zeros_like(state)  # an explicit opt-out still loads
    dcp.load(target, storage_reader=udcp.StorageReader(tmp_path / "c", verify="none"))
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_convert_from_dcp_keeps_json_state_and_lists_what_it_skips(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from unickpt.offline import convert_from_dcp

    model = llama(4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    _train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "when": datetime.date(2026, 1, 1), "loss": float("nan"), "epoch": 3,
              "tags": {1, 2}}, checkpoint_id=str(tmp_path / "dcp"))
    res = convert_from_dcp(tmp_path / "dcp", tmp_path / "uni")
    assert [s.split(":")[0] for s in res["skipped"]] == ["tags", "when"], res["skipped"]
    assert "weights_only" in res["skipped"][1] and "a set, not a JSON value" in res["skipped"][0]
    assert all(c >= " " for s in res["skipped"] for c in s), res["skipped"]  # torch's colour codes left out
    _, man = unickpt.read_manifest(tmp_path / "uni")
    assert man.state["epoch"] == 3 and man.extra["skipped_non_tensors"] == res["skipped"]
    assert man.state["loss"] == {"__unickpt_float__": "nan"}  # (NaN kept, encoded: docs/format.md)
    model2 = llama(5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    _train(model2, opt2, 1, seed=9)
    m2, o2 = get_state_dict(model2, opt2)
    unickpt.load({"model": m2, "optim": o2}, tmp_path / "uni")
    assert o2["param_groups"][0]["lr"] == 2e-3
    assert _same({"model": m2, "optim": o2}, {"model": msd, "optim": osd}) == []
    assert json.loads(json.dumps(man.state["optim"]["param_groups"][0]["params"])) == osd["param_groups"][0]["params"]


def test_verify_full_checks_bytes_the_target_does_not_ask_for(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = _mixed_state()
    unickpt.save(state, tmp_path / "c")
    _, man = unickpt.read_manifest(tmp_path / "c")
    st = man.tensors[("optimizer", "exp_avg_sq.b")]
    with open(tmp_path / "c" / st.file, "r+b") as f:
        f.seek(man.files[st.file].data_start + st.begin)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x80]))
    target = {"model": _zeros_like(state["model"])}
    dcp.load(target, storage_reader=udcp.StorageReader(tmp_path / "c"))  # reads model bytes only: intact
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"model": _zeros_like(state["model"])}, storage_reader=udcp.StorageReader(tmp_path / "c", verify="full"))
    assert ei.value.failures[0][0].bad == [(st.file, "exp_avg_sq.b")]


def _node_local(rank, world, root):
    import torch.distributed.checkpoint as dcp

    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"  # two "nodes", one rank each, each its own disk
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(8, 6, generator=g), "v": torch.randn(10, generator=g)}
    rows = slice(4 * rank, 4 * rank + 4)
    unickpt.save({"model": {"w": unickpt.shard(full["w"][rows].clone(), (8, 6), offsets=(4 * rank, 0)),
                            "v": full["v"]}, "step": 9}, os.path.join(root, "{node}", "step-00000009"))
    mine = sorted(os.listdir(os.path.join(root, f"n{rank}", "step-00000009")))
    target = {"model": {"w": torch.zeros(8, 6), "v": torch.zeros(10)}, "step": 0}
    dcp.load(target, storage_reader=udcp.StorageReader(os.path.join(root, "{node}")))
    return mine, _same(target, {"model": full, "step": 9})


def test_node_local_checkpoints_load_through_dcp_with_pieces_sent_by_their_node(tmp_path):
    out = dist.run(_node_local, 2, str(tmp_path))
    assert out[0][0] != out[1][0]  # each node holds other files
    assert [o[1] for o in out] == [[], []]


def _node_local_fails_on_rank_1(rank, world, root, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import unickpt.dcp as loader  # (the reader's reads: unickpt.loading.session.read_all, as dcp calls it)

    os.environ["UNICKPT_NODE_ID"] = f"n{rank}"  # two "nodes", one rank each, each its own disk
    full = torch.arange(48, dtype=torch.float32).view(8, 6)
    unickpt.save({"model": {"w": unickpt.shard(full[4 * rank : 4 * rank + 4].clone(), (8, 6), offsets=(4 * rank, 0))}},
                 os.path.join(root, "{node}", "step-00000001"))
    reader = udcp.StorageReader(os.path.join(root, "{node}"), verify="full", timeout_s=600)
    if rank == 1 and where == "reading":  # its own reads fail: its peer must not wait in the verification
        real, calls = loader.read_all, []

        def failing(*a, **k):  # its own reads come first; the reads it serves for its peer after
            calls.append(1)
            if len(calls) == 1:
                raise OSError(5, "injected read failure")
            return real(*a, **k)

        loader.read_all = failing
    if rank == 1 and where == "targets":  # a failure before its reads: its peer must not wait for them
        def broken(self, *a, **k):
            raise RuntimeError("injected planning failure")

        udcp.StorageReader._targets = broken
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"model": {"w": torch.zeros(8, 6)}}, storage_reader=reader)
    return str(ei.value)


@pytest.mark.parametrize("where", ["reading", "targets"])
def test_a_node_local_dcp_load_failing_on_one_rank_fails_the_other_at_once(tmp_path, where):
    """Node-local DCP loads are collective inside read_data (pieces sent by their node, the
    verify="full" share): a rank that fails before or during its reads still meets its peer
    there, so the peer fails at once, not after the 600 s timeout (job killed at 120 s)."""
    out = dist.run(_node_local_fails_on_rank_1, 2, str(tmp_path), where, timeout=120)  # a hang guard only
    for said in out:  # rank 1's own failure, told to rank 0 too: not a timeout waited out
        assert "injected" in said and not dist.waited_out(said), said
