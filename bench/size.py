"""Checkpoint size per parameter, by role, for every compression setting.

    .venv/bin/python bench/size.py [--hidden 256] [--layers 4] [--steps 30]

Trains the validation model (bf16 weights, fp32 masters, AdamW) for a few steps so the
moments are real, then saves its state with O0/O1/O2 x master full/residual/drop x zstd
off/on (level 3) and prints bytes per parameter of each role (files on disk, headers
included) and the save time. Targets (issue): O1 + residual <= 6.2 B/param, O2 + drop
<= 3.3 B/param. The uncompressed reference is 14 B/param (2 + 4 + 4 + 4).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import unickpt
from unickpt.train import LlamaConfig, OptimConfig, TextData, Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 16 * 16,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4)
    t = Trainer(cfg, TextData(seq_len=64, max_bytes=1 << 20), optim=OptimConfig(lr=3e-3, warmup=5, total_steps=args.steps),
                global_batch=8, micro_batch=8, dtype="bf16")
    t.fit(args.steps)
    sd = t.state_dict()
    n_params = sum(x.local.numel() if hasattr(x, "local") else x.numel() for x in sd["model"].values())
    root = args.dir or tempfile.mkdtemp(prefix="unickpt-size-")
    print(f"model: {n_params / 1e6:.2f} M parameters (bf16 weights, fp32 master, AdamW), {args.steps} steps trained")
    print(f"{'quant':<6}{'master':<10}{'zstd':<6}{'model':>8}{'master':>8}{'optim':>8}{'total':>8}  B/param   save s")
    rows = {}
    for quant in ("O0", "O1", "O2"):
        for master in ("full", "residual", "drop"):
            for zstd in (None, 3):
                p = os.path.join(root, f"{quant}-{master}-{zstd}")
                t0 = time.perf_counter()
                unickpt.save(sd, p, options=unickpt.SaveOptions(
                    compression=unickpt.Compression(quant=quant, master=master, zstd=zstd, eps=t.optim.eps)))
                secs = time.perf_counter() - t0
                _, man = unickpt.read_manifest(p)
                by = man.bytes_by_role()
                per = {r: by.get(r, 0) / n_params for r in ("model", "master", "optimizer")}
                total = sum(by.values()) / n_params
                rows[(quant, master, zstd)] = total
                print(f"{quant:<6}{master:<10}{str(zstd or '-'):<6}{per['model']:>8.2f}{per['master']:>8.2f}"
                      f"{per['optimizer']:>8.2f}{total:>8.2f}  {secs:8.2f}")
                shutil.rmtree(p)
    o1 = rows[("O1", "residual", None)]
    o2 = rows[("O2", "drop", None)]
    print(f"O1 + residual: {o1:.2f} B/param (target <= 6.2: {'met' if o1 <= 6.2 else 'MISSED'}); "
          f"O2 + drop: {o2:.2f} B/param (target <= 3.3: {'met' if o2 <= 3.3 else 'MISSED'}); "
          f"uncompressed {rows[('O0', 'full', None)]:.2f}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
