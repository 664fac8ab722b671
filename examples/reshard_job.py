"""One side of the demo, launched with torchrun: save a sharded state, or load it back
under another layout and check every byte.

    torchrun --standalone --nproc-per-node 4 examples/reshard_job.py save --layout zero --dir D
    torchrun --standalone --nproc-per-node 2 examples/reshard_job.py load --layout tp --dir D

The state is a small Llama-shaped model (bf16 weights, fp32 master weights, two fp32 Adam
moments) generated from a seed, so the loading side can rebuild the expected values.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import unickpt


def full_state(seed: int = 0, layers: int = 4, hidden: int = 256, vocab: int = 1000) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (3 * hidden, hidden),
            p + "mlp.up_proj.weight": (3 * hidden, hidden),
            p + "mlp.down_proj.weight": (hidden, 3 * hidden),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    master = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    return {
        "model": {n: t.bfloat16() for n, t in master.items()},
        "master": master,
        "exp_avg": {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()},
        "exp_avg_sq": {n: torch.rand(s, generator=g) * 1e-6 for n, s in shapes.items()},
    }


ROW_PARALLEL = ("o_proj", "down_proj")  # Megatron: split input dim (columns); the rest split rows


def zero_layout(full: dict, rank: int, world: int) -> dict:
    """ZeRO-3 style: each role's tensors flattened into one buffer, cut in equal ranges."""
    sd: dict = {}
    for role, tensors in full.items():
        names = list(tensors)
        parts = unickpt.partition_flat([tensors[n].shape for n in names], world, rank)
        buf = torch.empty(max((b for *_, b in parts), default=0), dtype=next(iter(tensors.values())).dtype)
        out = {}
        for i, lay, a, b in parts:
            src = tensors[names[i]].reshape(-1)[lay.flat[0] : lay.flat[1]]
            buf[a:b] = src
            out[names[i]] = unickpt.ShardedTensor(buf[a:b], lay)
        sd[role if role in ("model", "master") else "optimizer"] = (
            out if role in ("model", "master") else {**sd.get("optimizer", {}), role: out}
        )
    return sd


def tp_layout(full: dict, rank: int, world: int) -> dict:
    """Megatron TP: column-parallel rows, row-parallel columns, norms replicated."""
    sd: dict = {}
    for role, tensors in full.items():
        out = {}
        for n, t in tensors.items():
            if t.dim() == 1:
                out[n] = unickpt.shard(t.clone(), t.shape, replica=rank)
                continue
            dim = 1 if any(k in n for k in ROW_PARALLEL) else 0
            size = t.shape[dim] // world
            offsets = [0, 0]
            offsets[dim] = rank * size
            out[n] = unickpt.shard(t.narrow(dim, rank * size, size).contiguous(), t.shape, offsets=offsets)
        if role in ("model", "master"):
            sd[role] = out
        else:
            sd.setdefault("optimizer", {})[role] = out
    return sd


LAYOUTS = {"zero": zero_layout, "tp": tp_layout}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["save", "load"])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--step", type=int, default=100)
    ap.add_argument("--report", help="rank 0 appends a JSON line with its figures here")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    full = full_state()
    if args.action == "save":
        sd = LAYOUTS[args.layout](full, rank, world)
        sd["trainer"] = {"step": args.step, "data_position": 12345}
        path = os.path.join(args.dir, f"step-{args.step:08d}")
        t0 = time.perf_counter()
        res = unickpt.save(sd, path, step=args.step, strategy={"layout": args.layout, "world_size": world})
        fig = {"action": "save", "layout": args.layout, "world": world, "seconds": time.perf_counter() - t0, "bytes": res.bytes}
    else:
        zeros = {r: {n: torch.zeros_like(t) for n, t in d.items()} for r, d in full.items()}
        sd = LAYOUTS[args.layout](zeros, rank, world)
        sd["trainer"] = {"step": 0, "data_position": 0}
        t0 = time.perf_counter()
        res = unickpt.load(sd, args.dir)
        secs = time.perf_counter() - t0
        want = LAYOUTS[args.layout](full, rank, world)
        bad = 0
        for role, d in want.items():
            items = d.items() if role != "optimizer" else [(f"{m}.{n}", v) for m, sub in d.items() for n, v in sub.items()]
            got = sd[role] if role != "optimizer" else {f"{m}.{n}": v for m, sub in sd[role].items() for n, v in sub.items()}
            for n, v in items:
                bad += not torch.equal(got[n].local, v.local)
        assert sd["trainer"] == {"step": args.step, "data_position": 12345}, sd["trainer"]
        bads = [torch.tensor([bad])]
        dist.all_reduce(bads[0])
        if int(bads[0]) != 0:
            raise SystemExit(f"{int(bads[0])} tensors differ after resharding")
        fig = {"action": "load", "layout": args.layout, "world": world, "seconds": secs, "bytes_read": res.bytes_read}
    if rank == 0:
        print(json.dumps(fig), flush=True)
        if args.report:
            with open(args.report, "a") as f:
                f.write(json.dumps(fig) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
