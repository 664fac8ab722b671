"""Training fidelity of compressed checkpoints: does resuming from O1/O2 change training?

    .venv/bin/python bench/fidelity.py [--steps 300] [--hidden 128] [--layers 4]

On the validation trainer (Llama, bf16 weights + fp32 masters, AdamW, real text: the Python
standard library's sources), one process:

* the uninterrupted run of ``--steps`` steps;
* stop at the midpoint, save with O0 / O1 / O2 (masters: residual, i.e. exact, so only the
  moments differ; plus O2 with dropped masters), resume, finish;
* ``--cycles K ...``: K evenly spaced quantized save/resume cycles over the run (O1 and O2;
  default 5): error may add up;

and reports the final train loss (mean of the last 10 steps) and eval loss of each against
the uninterrupted run. Targets (issue): O1 <= 0.1 % relative eval-loss drift, O2 <= 0.5 %.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile

import torch

from unickpt.train import LlamaConfig, OptimConfig, TextData, Trainer, UnifiedCheckpoint


def run(args, root: str, name: str, saves: list[int], ckpt_kw: dict | None) -> tuple[float, float]:
    """Train to ``args.steps``, stopping (save, new trainer, resume) after every step in ``saves``."""
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 16 * 16,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4)
    losses: list[float] = []
    ev = float("nan")
    stops = saves + [args.steps]
    for i, stop in enumerate(stops):
        ck = UnifiedCheckpoint(dir=f"{root}/{name}", **(ckpt_kw or {})) if ckpt_kw is not None else None
        t = Trainer(cfg, TextData(seq_len=args.seq_len, seed=args.seed),
                    optim=OptimConfig(lr=args.lr, warmup=args.steps // 20, total_steps=args.steps),
                    checkpoint=ck, global_batch=args.batch, micro_batch=args.batch, dtype="bf16", seed=args.seed,
                    eval_samples=args.eval_samples, resume="auto" if i > 0 else None)
        out = t.fit(stop)
        losses += [r["loss"] for r in out]
        if stop != args.steps:
            t.save()
        ev = [h["eval_loss"] for h in t.history if "eval_loss" in h][-1]
    return statistics.mean(losses[-10:]), ev


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-samples", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cycles", type=int, nargs="*", default=[5],
                    help="numbers of evenly spaced quantized save/resume cycles to run (O1 and O2 each)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    root = tempfile.mkdtemp(prefix="unickpt-fidelity-")
    mid = args.steps // 2
    def cycles(k: int) -> list[int]:
        return [args.steps * j // (k + 1) for j in range(1, k + 1)]

    base_train, base_eval = run(args, root, "base", [], None)
    from unickpt.train.model import param_specs

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 16 * 16,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4)
    n = sum(math.prod(s) for _, s, _ in param_specs(cfg))
    print(f"uninterrupted: {n / 1e6:.2f} M parameters, {args.steps} steps, train loss (last 10) {base_train:.5f}, "
          f"eval loss {base_eval:.5f}")
    print(f"{'resume':<26}{'train loss':>12}{'delta':>10}{'eval loss':>12}{'delta':>10}  target")
    cases = [
        ("O0 at midpoint", [mid], dict(master="residual"), None),
        ("O1 at midpoint", [mid], dict(quant="O1", master="residual"), 0.001),
        ("O2 at midpoint", [mid], dict(quant="O2", master="residual"), 0.005),
        ("O2 + drop at midpoint", [mid], dict(quant="O2", master="drop"), None),
    ]
    for k in args.cycles:
        cases += [(f"O1 x{k} cycles", cycles(k), dict(quant="O1", master="residual"), None),
                  (f"O2 x{k} cycles", cycles(k), dict(quant="O2", master="residual"), None)]
    for i, (label, saves, kw, target) in enumerate(cases):
        tr, ev = run(args, root, f"c{i}", saves, kw)
        dt, de = (tr - base_train) / base_train, (ev - base_eval) / base_eval
        verdict = "" if target is None else (f"<= {target:.1%}: " + ("met" if abs(de) <= target else "MISSED"))
        print(f"{label:<26}{tr:>12.5f}{dt:>+10.3%}{ev:>12.5f}{de:>+10.3%}  {verdict}")
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
