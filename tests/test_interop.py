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
