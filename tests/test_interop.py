"""torch.distributed interop: FSDP2 (fully_shard) and tensor-parallel (parallelize_module)
state dicts from get_state_dict save and load through unickpt, resharded between them and
into plain single-process models."""

import os

import torch

import unickpt
from tests import dist


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _train_steps(model, opt, steps=2):
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _fsdp_save(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, opt)
    msd, osd = get_state_dict(model, opt)
    unickpt.save({"model": msd, "optim": osd}, os.path.join(root, "fsdp"))
    return {k: v.full_tensor().tolist() for k, v in msd.items()}  # plain lists cross the process boundary


def _tp_load(rank, world, root, want):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(_model(seed=99), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, opt, 1)  # materialise optimizer state with other values
    msd, osd = get_state_dict(model, opt)
    unickpt.load({"model": msd, "optim": osd}, os.path.join(root, "fsdp"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return all(torch.equal(got[k], torch.tensor(want[k])) for k in want)


def test_fsdp2_to_tensor_parallel_and_to_a_plain_model(tmp_path):
    root = str(tmp_path)
    want = dist.run(_fsdp_save, 2, root)[0]
    assert dist.run(_tp_load, 2, root, want) == [True, True]
    plain = _model(seed=5)
    sd = {"model": plain.state_dict()}
    unickpt.load(sd, os.path.join(root, "fsdp"))
    for k, v in want.items():
        assert torch.equal(plain.state_dict()[k], torch.tensor(v)), k


def _trainer_and_fsdp2(rank, world, root):
    """The validation trainer (ZeRO-2 x 2) saves; an FSDP2 (fully_shard) Llama of the same
    config loads its weights (names mapped module -> HF by ``Llama.hf_params``), changes them
    and saves; a TP-2 trainer loads those; its pieces, saved again, equal the FSDP2 weights."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unickpt.train import LlamaConfig, ParallelConfig, TextData, Trainer, UnifiedCheckpoint
    from unickpt.train.model import Llama

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    data = TextData(seq_len=16, max_bytes=1 << 18)
    t = Trainer(cfg, data, parallel=ParallelConfig(zero_stage=2), checkpoint=UnifiedCheckpoint(dir=os.path.join(root, "tr")),
                global_batch=4, micro_batch=2)
    t.fit(2)
    t.save()
    full = {k: torch.zeros(v.layout.shape) for k, v in t.state_dict()["model"].items()}
    unickpt.load({"model": full}, os.path.join(root, "tr"), group=unickpt.transport.LOCAL)

    mesh = init_device_mesh("cpu", (world,))
    model = Llama(cfg)
    for blk in model.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    by_param = {id(p): hf for hf, p, _, _ in model.hf_params()}
    hf = {fqn: by_param[id(p)] for fqn, p in model.named_parameters()}
    msd = get_model_state_dict(model)
    assert set(hf) == set(msd)
    unickpt.load({"model": {hf[k]: v for k, v in msd.items()}}, os.path.join(root, "tr"))
    set_model_state_dict(model, msd)
    ok_in = all(torch.equal(p.full_tensor(), full[hf[k]]) for k, p in model.named_parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    msd = get_model_state_dict(model)
    unickpt.save({"model": {hf[k]: v for k, v in msd.items()}}, os.path.join(root, "fsdp"))

    t2 = Trainer(cfg, data, parallel=ParallelConfig(tp=2), global_batch=4, micro_batch=2)
    pieces = t2.state_dict()["model"]
    unickpt.load({"model": pieces}, os.path.join(root, "fsdp"))
    unickpt.save({"model": pieces}, os.path.join(root, "tp-again"))
    back = {k: torch.zeros(v.shape) for k, v in full.items()}
    unickpt.load({"model": back}, os.path.join(root, "tp-again"), group=unickpt.transport.LOCAL)
    ok_out = all(torch.equal(back[k], full[k] * -2.0) for k in full)
    return ok_in, ok_out


def test_trainer_layouts_and_fsdp2_reshard_both_ways(tmp_path):
    assert dist.run(_trainer_and_fsdp2, 2, str(tmp_path)) == [(True, True)] * 2


def _dtensor_on_a_submesh(rank, world, root):
    import pytest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from unickpt.errors import LayoutError, StateDictError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(15.0).view(5, 3)
    dt = distribute_tensor(full, mesh["tp"], [Shard(0)])  # TP under DDP: 2 copies, all replica 0
    unickpt.save({"model": {"w": dt}, "optim": {"m": distribute_tensor(full * 2, mesh["tp"], [Shard(1)])}},
                        os.path.join(root, "a"))
    t = {"model": {"w": distribute_tensor(torch.zeros(5, 3), mesh["tp"], [Shard(1)])}}
    unickpt.load(t, os.path.join(root, "a"))
    ok_load = torch.equal(t["model"]["w"].full_tensor(), full)
    plain = {"optim": {"m": torch.zeros(5, 3)}}
    unickpt.load(plain, os.path.join(root, "a"), group=unickpt.transport.LOCAL)
    ok_plain = torch.equal(plain["optim"]["m"], full * 2)

    # copies that differ: refused on every rank, nothing committed
    local = dt.to_local().clone()
    if mesh["dp"].get_local_rank() == 1 and mesh["tp"].get_local_rank() == 0:
        local[0, 0] = -1.0  # rank 2 differs from rank 0
    bad = torch.distributed.tensor.DTensor.from_local(local, mesh["tp"], [Shard(0)], run_check=False, shape=dt.shape,
                                                    stride=dt.stride())
    with pytest.raises(StateDictError, match=r"block at offsets \[0, 0\].*different values: rank 0 holds one value, rank 2 another"):
        unickpt.save({"model": {"w": bad}}, os.path.join(root, "b"))

    # compared as given, not as encoded: residual masters keep only their low 16 bits
    big = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    master = big.clone()
    if rank == 2:
        master.view(torch.int32)[0, 0] ^= 1 << 20  # another upper half, the same low 16 bits
    sd = {"model": {"w": distribute_tensor(big.bfloat16(), mesh["tp"], [Shard(0)])},
          "master": {"w": torch.distributed.tensor.DTensor.from_local(
              master[32 * mesh["tp"].get_local_rank():][:32], mesh["tp"], [Shard(0)], run_check=False,
              shape=(64, 64), stride=(64, 1))}}
    with pytest.raises(StateDictError, match=r"tensor 'w' \(role master\).*rank 0 holds one value, rank 2 another"):
        unickpt.save(sd, os.path.join(root, "d"), master="residual")

    # the whole tensor on one rank and a part of it on another, both as the saved copy: refused
    piece = unickpt.shard(full, full.shape) if rank == 0 else unickpt.shard(full[:2], full.shape, offsets=(0, 0))
    with pytest.raises(LayoutError, match=r"rank 0 holds it whole .* rank 1 holds a part of it"):
        unickpt.save({"model": {"w": piece}}, os.path.join(root, "c"))
    return ok_load, ok_plain


def test_dtensors_on_a_submesh_with_data_parallel_copies_save_one_copy_and_compare_the_others(tmp_path):
    """DTensors on a TP sub-mesh under DDP: every data-parallel group holds a full set of the
    same blocks, all replica 0 (a DTensor has no say about copies outside its mesh). The plan
    saves the lowest rank's copy of each block and the save compares the others with it by
    fingerprint, as for plain tensors: copies that differ are refused naming the ranks. A
    whole tensor on one rank beside a part of it on another, both replica 0, is refused."""
    out = dist.run(_dtensor_on_a_submesh, 4, str(tmp_path))
    assert out == [(True, True)] * 4
    assert not any(os.path.exists(tmp_path / d) for d in "bcd")


def _fsdp_over_tp(rank, world, root):
    """FSDP2 over tensor parallelism on a (dp 2, tp 2) mesh: its DTensors' dp placement is
    _StridedShard (FSDP's shard of each TP shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.hf_models import llama

    def build(seed):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        m = llama(seed)
        for layer in m.model.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    model, opt = build(0)
    x = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    strided = sum("_StridedShard" in str(p.placements) for p in model.parameters())
    # every DTensor, strided ones included, is described by its grid rule: no explicit rows
    # (each would be one row per rank and tensor in every rank's plan)
    from unickpt.format import dtype_name
    from unickpt.plan import summarize
    from unickpt.state import flatten

    entries, _ = flatten({"model": model.state_dict()}, rank, world)
    rows = len(summarize(entries, [dtype_name(e.local.dtype) for e in entries], "n0").rows)
    strided = strided if rows == 0 else -rows
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    unickpt.save({"model": model, "optim": opt}, os.path.join(root, "2d"))
    m2, o2 = build(1)
    m2(input_ids=x, labels=x).loss.backward()
    o2.step()  # (state to load into)
    unickpt.load({"model": m2, "optim": o2}, os.path.join(root, "2d"))
    same = all(torch.equal(v.full_tensor(), full[k]) for k, v in m2.state_dict().items())
    moments = all(torch.equal(o2.state[p]["exp_avg"].full_tensor(), opt.state[q]["exp_avg"].full_tensor())
                  for p, q in zip(m2.parameters(), model.parameters()))
    plain = llama(2)  # one plain process (each rank on its own)
    unickpt.load({"model": plain}, os.path.join(root, "2d"), strict=False, group=unickpt.transport.LOCAL)
    one = all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())

    # strided on dimension 1: RowwiseParallel (Shard(1)) under fully_shard(shard_placement_fn=Shard(1))
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(3)
    lin = parallelize_module(torch.nn.Linear(8, 8, bias=False), mesh["tp"], RowwiseParallel())
    fully_shard(lin, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
    w = lin.weight
    unickpt.save({"lin": lin}, os.path.join(root, "dim1"))
    back = torch.nn.Linear(8, 8, bias=False)
    unickpt.load({"lin": back}, os.path.join(root, "dim1"), group=unickpt.transport.LOCAL)
    dim1 = "_StridedShard(dim=1" in str(w.placements) and torch.equal(back.weight.detach(), w.full_tensor())
    return strided, same, moments, one and dim1


def test_fsdp2_over_tensor_parallelism_saves_and_loads_in_any_layout(tmp_path):
    """FSDP2 x TP (torchtitan's 2-D layout): _StridedShard placements are boxes of the full
    tensor, saved and loaded like any DTensor, back into 2-D and into one plain process."""
    out = dist.run(_fsdp_over_tp, 4, str(tmp_path))
    assert all(o[0] > 0 and o[1:] == (True, True, True) for o in out), out
