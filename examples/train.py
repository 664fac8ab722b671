"""Train the validation model; launch with torchrun.

    torchrun --standalone --nproc-per-node N examples/train.py --zero-stage S --tp T \
        --steps K --save-every E --ckpt-dir D [--resume] [--dtype fp32|bf16] [--seed X] \
        [--global-batch B] [--eval-every E] [--metrics-jsonl FILE] \
        [--memory-dir /dev/shm/run --memory-every N --memory-replicas R --memory-keep K --memory-wait]

``--steps`` is the total optimizer step count: a resumed run continues to the same end.
``--resume`` continues from the newest committed checkpoint under ``--ckpt-dir`` (saved
under any strategy), or, with ``--memory-dir``, from the newest step complete in either tier
(memory snapshots on this job's nodes and their replicas first; docs/memory_tier.md).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os

import torch
import torch.distributed as dist

from unickpt import UnifiedCheckpoint
from unickpt.train import LlamaConfig, OptimConfig, ParallelConfig, TextData, Trainer


def _gib(text: str) -> float:
    """A positive, finite number of GiB (argparse type)."""
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--stop-at", type=int, default=0, help="stop after this step, as if preempted")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--keep", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="runs/train/ckpt")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--quant", choices=["O0", "O1", "O2"], default="O0", help="Adam moments: O1 8-bit, O2 4-bit")
    ap.add_argument("--master-weights", choices=["full", "residual", "drop"], default="full",
                    help="fp32 master weights in checkpoints (not --master: torchrun would take it for --master-addr)")
    ap.add_argument("--zstd", type=int, default=None, metavar="LEVEL", help="zstd for optimizer and master files")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--memory-dir", default=None, help="in-memory tier: node-local tmpfs directory ({node} expanded)")
    ap.add_argument("--memory-every", type=int, default=1, help="memory snapshot every N steps")
    ap.add_argument("--memory-replicas", type=int, default=None, help="other nodes holding copies (default 1 if >1 node)")
    ap.add_argument("--memory-keep", type=int, default=2, help="memory snapshots kept per node")
    ap.add_argument("--memory-wait", action="store_true",
                    help="wait for the previous snapshot instead of skipping one due while it is written")
    ap.add_argument("--memory-budget", type=_gib, default=None, metavar="GIB", help="host memory per node for the tier")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--metrics-jsonl")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 16 * 16 or 16,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
    )
    trainer = Trainer(
        cfg,
        TextData(seq_len=args.seq_len, seed=args.seed),
        parallel=ParallelConfig(zero_stage=args.zero_stage, tp=args.tp),
        optim=OptimConfig(lr=args.lr, warmup=max(1, args.steps // 20), total_steps=args.steps),
        checkpoint=UnifiedCheckpoint(
            dir=args.ckpt_dir, every=args.save_every, keep=args.keep, async_save=args.async_save,
            quant=None if args.quant == "O0" else args.quant, master=args.master_weights, zstd=args.zstd,
            memory_dir=args.memory_dir, memory_every=args.memory_every, memory_replicas=args.memory_replicas,
            memory_keep=args.memory_keep, memory_skip_busy=not args.memory_wait,
            memory_budget=None if args.memory_budget is None else int(args.memory_budget * (1 << 30)),
        ),
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        dtype=args.dtype,
        seed=args.seed,
        eval_every=args.eval_every,
        metrics_jsonl=args.metrics_jsonl,
        resume="auto" if args.resume else None,
        device=device,
    )
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"world {world}: zero-{args.zero_stage}, tp {args.tp}, dp {world // args.tp}, {args.dtype}; "
              f"starting at step {trainer.step} of {args.steps}", flush=True)
    end = min(args.steps, args.stop_at) if args.stop_at else args.steps
    while trainer.step < end:
        rec = trainer.train_step()
        if rank == 0 and (rec["step"] % args.log_every == 0 or rec["step"] == args.steps):
            print(f"step {rec['step']:5d}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:.0f} tok/s", flush=True)
        trainer.checkpoint_step()  # memory snapshot and/or durable checkpoint, when due
        if args.eval_every and rec["step"] % args.eval_every == 0 and rec["step"] < args.steps:
            trainer.evaluate()
    trainer.close()  # the save in flight durable and reported; memory snapshots freed
    ev = trainer.evaluate()
    if rank == 0:
        print(f"eval loss {ev:.4f} at step {trainer.step}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    # the process groups the trainer holds are freed (their threads joined) while the
    # interpreter is whole: a gloo thread still releasing the last collective's tensors
    # during interpreter shutdown aborts the process ("terminate called without an active
    # exception", pytorch/pytorch#190489)
    del trainer
    gc.collect()


if __name__ == "__main__":
    main()
