"""`make demo`: the whole story on CPU with several local ranks.

1. 4 ranks (torchrun, gloo) save a ZeRO-partitioned training state (bf16 weights, fp32
   master weights, two Adam moments: ranges cut across tensors).
2. 2 ranks load it under Megatron-style tensor parallelism and check every byte.
3. 1 process loads the model part with plain safetensors; `unickpt inspect` and
   `unickpt verify` describe and check the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def torchrun(n: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.join(HERE, "reshard_job.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    subprocess.run(cmd, check=True, env=env)


def main() -> None:
    out = os.path.join(ROOT, "runs", "demo")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ckpt, report = os.path.join(out, "ckpt"), os.path.join(out, "figures.jsonl")
    print("== 4 ranks, ZeRO partitions: save ==", flush=True)
    torchrun(4, "save", "--layout", "zero", "--dir", ckpt, "--report", report)
    print("== 2 ranks, tensor parallel: load (resharded) and compare ==", flush=True)
    torchrun(2, "load", "--layout", "tp", "--dir", ckpt, "--report", report)
    print("== inspect ==", flush=True)
    subprocess.run([sys.executable, "-m", "unickpt.cli", "inspect", ckpt], check=True)
    print("== verify ==", flush=True)
    subprocess.run([sys.executable, "-m", "unickpt.cli", "verify", ckpt], check=True)
    from safetensors.torch import load_file

    import unickpt

    path = unickpt.latest(ckpt)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    model = {}
    for fname in sorted(set(index["weight_map"].values())):
        model.update(load_file(os.path.join(path, fname)))
    print(f"plain safetensors read {len(model)} whole model tensors, e.g. "
          f"lm_head.weight {tuple(model['lm_head.weight'].shape)} {model['lm_head.weight'].dtype}")
    figs = [json.loads(line) for line in open(report)]
    save = next(f for f in figs if f["action"] == "save")
    load = next(f for f in figs if f["action"] == "load")
    print("\n== report ==")
    print(f"save : {save['world']} ranks ({save['layout']}), {save['bytes'] / 1e6:.1f} MB in {save['seconds']:.2f} s")
    print(f"load : {load['world']} ranks ({load['layout']}), {load['bytes_read'] / 1e6:.1f} MB read by rank 0 in {load['seconds']:.2f} s, bit-exact")
    print("The trainer-based demo (train, resume under another strategy) comes with the validation trainer.")


if __name__ == "__main__":
    main()
