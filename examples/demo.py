"""`make demo`: the whole story on CPU with several local ranks, in a couple of minutes.

1. Train the validation model (Llama-style, real text: the stdlib's own sources) on 4 ranks
   with ZeRO-2, checkpoint at step 20 and stop there, as if preempted.
2. Resume on 2 ranks with tensor parallelism (TP=2): unickpt reshards weights, fp32 master
   weights and Adam moments; train to step 40.
3. For comparison, the same 40 steps uninterrupted on 4 ranks (ZeRO-2).
4. Inspect and verify the checkpoint; report losses around the resume, sizes by role, and
   save / load seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, STOP = 40, 20
TOLERANCE = 1e-5  # relative: a resume in another layout changes only the order of float sums


def torchrun(n: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.join(HERE, "train.py"), "--steps", str(STEPS), "--log-every", "10", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env)


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    out = os.path.join(ROOT, "runs", "demo")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ckpt = os.path.join(out, "ckpt")
    m1, m2, mref = (os.path.join(out, f) for f in ("part1.jsonl", "part2.jsonl", "reference.jsonl"))
    print(f"== 1. train on 4 ranks, ZeRO-2; save at step {STOP} and stop ==", flush=True)
    torchrun(4, "--zero-stage", "2", "--save-every", str(STOP), "--stop-at", str(STOP), "--ckpt-dir", ckpt, "--metrics-jsonl", m1)
    print(f"== 2. resume on 2 ranks, TP=2, ZeRO-0; continue to step {STEPS} ==", flush=True)
    torchrun(2, "--tp", "2", "--resume", "--ckpt-dir", ckpt, "--metrics-jsonl", m2)
    print(f"== 3. reference: {STEPS} steps uninterrupted on 4 ranks, ZeRO-2 ==", flush=True)
    torchrun(4, "--zero-stage", "2", "--ckpt-dir", os.path.join(out, "unused"), "--metrics-jsonl", mref)
    print("== 4. unickpt inspect / verify ==", flush=True)
    step_dir = os.path.join(ckpt, f"step-{STOP:08d}")
    subprocess.run([sys.executable, "-m", "unickpt.cli", "inspect", step_dir], check=True)
    subprocess.run([sys.executable, "-m", "unickpt.cli", "verify", step_dir], check=True)

    a, b, ref = read(m1), read(m2), read(mref)
    loss = {r["step"]: r["loss"] for r in a + b if "loss" in r}
    ref_loss = {r["step"]: r["loss"] for r in ref if "loss" in r}
    save = next(r for r in a if r.get("event") == "save")
    load = next(r for r in b if r.get("event") == "load")
    evals = [r for r in b if r.get("event") == "eval"]
    ref_eval = [r for r in ref if r.get("event") == "eval"]
    from unickpt import read_manifest

    _, man = read_manifest(step_dir)
    print("\n== report ==")
    print("step   resumed run (ZeRO-2 x4 -> TP2 x2)   uninterrupted (ZeRO-2 x4)   rel. diff")
    for s in range(STOP - 2, STOP + 4):
        print(f"{s:4d}   {loss[s]:.6f}{'  <- resumed here' if s == STOP + 1 else '':<18}        {ref_loss[s]:.6f}       {abs(loss[s] - ref_loss[s]) / ref_loss[s]:.1e}")
    print(f"final eval loss: resumed {evals[-1]['eval_loss']:.6f}, uninterrupted {ref_eval[-1]['eval_loss']:.6f}")
    print("checkpoint size by role: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in man.bytes_by_role().items()))
    print(f"save (4 ranks): {save['total_s']:.2f} s for {save['bytes'] / 2**20:.2f} MiB; "
          f"load + reshard (2 ranks): {load['seconds']:.2f} s, {load['bytes_read'] / 2**20:.2f} MiB read by rank 0")
    # the verdict: every step after the resume, and the final eval, match the uninterrupted run
    # (another layout sums in another order: float rounding, ~1e-7, not bit-identical)
    after = [s for s in ref_loss if s > STOP]
    worst = max(abs(loss[s] - ref_loss[s]) / ref_loss[s] for s in after) if after else float("inf")
    ev = abs(evals[-1]["eval_loss"] - ref_eval[-1]["eval_loss"]) / ref_eval[-1]["eval_loss"]
    ok = bool(after) and all(s in loss for s in after) and worst <= TOLERANCE and ev <= TOLERANCE
    print(f"\nVERDICT: {'PASS' if ok else 'FAIL'}: the run saved at step {STOP} on 4 ranks (ZeRO-2) and resumed on 2 "
          f"(TP=2) matches the uninterrupted run over steps {STOP + 1}..{max(after, default=STOP)} (largest relative "
          f"difference {worst:.1e}, final eval {ev:.1e}; tolerance {TOLERANCE:g})", flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
