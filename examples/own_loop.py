"""Your own training loop with unickpt: FSDP2 over a ``transformers`` Llama, AdamW, a cosine
schedule and a data loader whose state holds bytes, checkpointed by ``unickpt.UnifiedCheckpoint``
in four calls (asynchronous saves, an in-memory tier, the newest 2 durable checkpoints kept).

    torchrun --nproc-per-node 2 examples/own_loop.py --dir ckpt --memory-dir /dev/shm/own_loop --steps 20
    python examples/own_loop.py --dir ckpt --steps 20          # one process: no FSDP

Kill it at any moment (kill -9 included) and run the same command again, on as many ranks as
you like: it resumes from the newest step complete in memory or on disk. Each optimizer step
prints one JSON line (``{"step": ..., "loss": ...}``); the last line is a verdict.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import pickle

import torch
import torch.distributed as dist

import unickpt


class TokenLoader:
    """Deterministic batches of a synthetic corpus; its state is what a real loader keeps (a
    position, and an opaque ``bytes`` blob: the shuffle generator's state, pickled as data
    loaders of torchtitan do). The same on every rank: each rank takes its share of the
    global batch, so a resume on another number of ranks sees the same data."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int = 0) -> None:
        self.vocab, self.seq_len, self.global_batch = vocab, seq_len, global_batch
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next(self, rank: int, world: int) -> torch.Tensor:
        batch = torch.randint(0, self.vocab, (self.global_batch, self.seq_len + 1), generator=self.gen)
        self.position += self.global_batch
        share = self.global_batch // world
        return batch[rank * share:(rank + 1) * share]

    def state_dict(self) -> dict:
        return {"position": self.position, "shuffle": pickle.dumps(self.gen.get_state().numpy().tobytes())}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]
        self.gen.set_state(torch.frombuffer(bytearray(pickle.loads(sd["shuffle"])), dtype=torch.uint8))


def build(args: argparse.Namespace, world: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab,
                      max_position_embeddings=args.seq_len)
    model = AutoModelForCausalLM.from_config(cfg)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)

    def cosine(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, cosine)
    return model, optim, sched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="durable checkpoints (step-* directories)")
    p.add_argument("--memory-dir", default=None, help="in-memory tier, e.g. /dev/shm/run (default: off)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="a durable checkpoint every N steps")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this step without closing (a crash)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    model, optim, sched = build(args, world)
    loader = TokenLoader(args.vocab, args.seq_len, args.global_batch, args.seed)
    state = {"model": model, "optim": optim, "sched": sched, "data": loader, "step": 0}

    def on_event(e: dict) -> None:
        if rank == 0 and e["event"] in ("save", "load"):
            print(json.dumps({k: e[k] for k in ("event", "tier", "step")}), flush=True)

    # the four calls: construct, resume, step, close
    ckpt = unickpt.UnifiedCheckpoint(args.dir, every=args.every, keep=2, async_save=True, memory_dir=args.memory_dir,
                                     memory_every=1, memory_skip_busy=False, on_event=on_event)
    start = ckpt.resume(state) or 0  # the step dict entry is restored with the rest
    for step in range(start, args.steps):
        tokens = loader.next(rank, world)
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        out.loss.backward()
        ckpt.wait_for_staging()  # the previous save's copy is done before the weights change
        optim.step()
        optim.zero_grad(set_to_none=True)
        sched.step()
        loss = out.loss.detach().clone()
        if world > 1:  # the mean over ranks of their shares' mean losses: the global batch's
            dist.all_reduce(loss)
            loss /= world
        state["step"] = step + 1
        if rank == 0:
            print(json.dumps({"step": step + 1, "loss": loss.item()}), flush=True)
        ckpt.step(step + 1, state)
        if args.stop_at and step + 1 == args.stop_at:
            ckpt.wait()
            if rank == 0:
                print(f"stopped at step {step + 1} without closing (as a crash would)", flush=True)
            os._exit(0)
    ckpt.close()
    if rank == 0:
        print(f"done: {world} rank(s), steps {start + 1}..{args.steps}; checkpoints in {args.dir} "
              f"(newest durable: {unickpt.latest(args.dir)})", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    del model, optim, sched, state, ckpt  # process groups freed while the interpreter is whole
    gc.collect()


if __name__ == "__main__":
    main()
