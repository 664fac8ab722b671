"""Reference state and the parallel layouts the resharding matrix saves and loads under.

Each builder maps the full reference tensors to one rank's state dict: plain tensors, ZeRO
flat partitions (pieces are views into one flat buffer per role and dtype, ranges cut
across tensors, sizes not divisible by the world size), TP row/column blocks (uneven), TP x
ZeRO, and DTensor placements on 1-D and 2-D meshes.
"""

from __future__ import annotations


import torch

from unickpt.layout import Layout, ShardedTensor


def reference(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g).to(dtype)

    model = {
        "embed.weight": rn(37, 24, dtype=torch.bfloat16),
        "layers.0.qkv.weight": rn(30, 24, dtype=torch.bfloat16),
        "layers.0.o.weight": rn(24, 10, dtype=torch.bfloat16),
        "layers.0.norm.weight": rn(24, dtype=torch.bfloat16),
        "head.weight": rn(11, 24, dtype=torch.bfloat16),
        "counter": torch.arange(13, dtype=torch.int64) * 7 - 3,
        "big.weight": rn(700, 129),  # > 256 KiB: large pieces are written in place by holders
        "temperature": rn(),
    }
    master = {k: rn(*v.shape) for k, v in model.items() if v.dtype == torch.bfloat16}
    exp_avg = {k: rn(*v.shape) for k, v in master.items()}
    return {"model": model, "master": master, "optimizer": {"exp_avg": exp_avg}}


def _roles(full):
    """(role, name, tensor) in a fixed order; optimizer moments become role 'optimizer' with
    names 'exp_avg.<param>'."""
    out = []
    for role, d in full.items():
        if role == "optimizer":
            for moment, sub in d.items():
                for n, t in sub.items():
                    out.append((role, f"{moment}.{n}", t))
        else:
            for n, t in d.items():
                out.append((role, n, t))
    return out


def _nest(items):
    sd: dict = {}
    for role, name, v in items:
        if role == "optimizer":
            moment, param = name.split(".", 1)
            sd.setdefault(role, {}).setdefault(moment, {})[param] = v
        else:
            sd.setdefault(role, {})[name] = v
    return sd


def full(full_sd, rank, world):
    return _nest([(r, n, t.clone()) for r, n, t in _roles(full_sd)])


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk-style uneven split: ceil-sized chunks, the last ones shorter or empty."""
    c = -(-n // parts)
    lo = min(i * c, n)
    return lo, min(lo + c, n)


def _zero_items(items, world, rank, replica=0):
    """Flatten tensors per (role, dtype) into one buffer and keep this rank's range."""
    out = []
    groups: dict = {}
    for role, name, shape_t, lay_box, local_block in items:
        groups.setdefault((role, local_block.dtype), []).append((name, shape_t, lay_box, local_block))
    for (role, dtype), members in groups.items():
        blocks = [b.reshape(-1) for _, _, _, b in members]
        flat = torch.cat(blocks) if blocks else torch.zeros(0, dtype=dtype)
        total = -(-flat.numel() // world) * world
        part = total // world
        lo, hi = rank * part, (rank + 1) * part
        buf = torch.zeros(part, dtype=dtype)
        src_hi = min(hi, flat.numel())
        if src_hi > lo:
            buf[: src_hi - lo] = flat[lo:src_hi]
        t0 = 0
        for (name, shape, box, block), b in zip(members, blocks):
            t1 = t0 + b.numel()
            s, e = max(lo, t0), min(hi, t1)
            if e > s:
                lay = Layout(shape, box.offsets, box.sizes, (s - t0, e - t0), replica)
                out.append((role, name, ShardedTensor(buf[s - lo : e - lo], lay)))
            t0 = t1
    return out


def zero(full_sd, rank, world):
    items = [(r, n, tuple(t.shape), Layout.full(t.shape), t) for r, n, t in _roles(full_sd)]
    return _nest(_zero_items(items, world, rank))


def _tp_block(t: torch.Tensor, dim: int, tp: int, tr: int):
    if t.dim() < 2:
        return Layout.full(tuple(t.shape), replica=tr), t.clone()
    lo, hi = _chunk(t.shape[dim], tp, tr)
    offsets = [0] * t.dim()
    sizes = list(t.shape)
    offsets[dim], sizes[dim] = lo, hi - lo
    block = t.narrow(dim, lo, hi - lo).contiguous()
    return Layout(tuple(t.shape), tuple(offsets), tuple(sizes), None, 0), block


def _tp(dim):
    def build(full_sd, rank, world):
        out = []
        for r, n, t in _roles(full_sd):
            lay, block = _tp_block(t, dim, world, rank)
            out.append((r, n, ShardedTensor(block, lay)))
        return _nest(out)

    return build


def tp_zero(full_sd, rank, world, tp=2):
    """Megatron-style: tp rank = rank % tp (column split of every 2-D tensor), then ZeRO
    over the dp group of each tp rank's blocks flattened into one buffer."""
    dp = world // tp
    tr, dr = rank % tp, rank // tp
    items = []
    for r, n, t in _roles(full_sd):
        lay, block = _tp_block(t, 1, tp, tr)
        items.append((r, n, tuple(t.shape), lay, block))
    # 1-D tensors are replicated over tp: only tp rank 0's partition is replica 0
    out = []
    is_rep = [i[3].replica > 0 for i in items]
    rep = [i for i, x in zip(items, is_rep) if x]
    main = [i for i, x in zip(items, is_rep) if not x]
    out += _zero_items(main, dp, dr)
    out += _zero_items(rep, dp, dr, replica=tr)
    return _nest(out)


def dtensor(full_sd, rank, world, mesh_shape=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh_shape = mesh_shape or (world,)
    mesh = init_device_mesh("cpu", mesh_shape)
    out = []
    for i, (r, n, t) in enumerate(_roles(full_sd)):
        if t.dim() >= 2:
            if len(mesh_shape) == 1:
                pl = [Shard(i % 2)]
            else:
                pl = [Shard(0), Shard(1)] if i % 2 else [Replicate(), Shard(0)]
        elif t.dim() == 1:
            pl = [Shard(0)] * len(mesh_shape) if i % 2 else [Replicate()] * len(mesh_shape)
        else:
            pl = [Replicate()] * len(mesh_shape)
        shape, off = compute_local_shape_and_global_offset(t.shape, mesh, pl)
        local = t[tuple(slice(o, o + s) for o, s in zip(off, shape))].clone()
        dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=t.shape, stride=t.stride())
        out.append((r, n, dt))
    return _nest(out)


LAYOUTS = {
    "full1": (1, full),
    "full2": (2, full),
    "zero2": (2, zero),
    "zero3": (3, zero),
    "zero4": (4, zero),
    "tprow2": (2, _tp(0)),
    "tpcol2": (2, _tp(1)),
    "tpcol3": (3, _tp(1)),
    "tp2zero2": (4, tp_zero),
    "dtensor2": (2, dtensor),
    "dtensor3": (3, dtensor),
    "dtensor2x2": (4, lambda f, r, w: dtensor(f, r, w, (2, 2))),
}


def build(name, full_sd, rank, world):
    w, fn = LAYOUTS[name]
    assert w == world, (name, w, world)
    return fn(full_sd, rank, world)


def zeros_like_full(full_sd):
    return {
        role: ({k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in d.items()} if role == "optimizer"
               else {n: torch.zeros_like(t) for n, t in d.items()})
        for role, d in full_sd.items()
    }


def leaves(sd, prefix=""):
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from leaves(v, key + "/")
        else:
            yield key, v


def local_of(v) -> torch.Tensor:
    if isinstance(v, ShardedTensor):
        return v.local
    if hasattr(v, "to_local"):
        return v.to_local()
    return v


def assert_same(got_sd, want_sd, what=""):
    g = dict(leaves(got_sd))
    w = dict(leaves(want_sd))
    assert g.keys() == w.keys(), (what, sorted(set(g) ^ set(w)))
    for k in w:
        a, b = local_of(g[k]), local_of(w[k])
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.shape, b.shape)
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b), f"{what}: {k} differs"
