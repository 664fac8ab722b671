"""Async save of GPU-resident state: blocking time against the pinned device-to-host floor
and DCP, one process, one GPU (run on a CUDA machine).

    python bench/cuda_async.py [--gb 2.0] [--repeats 3] [--dir PATH]

State: fp32 weights + Adam exp_avg + exp_avg_sq of a GPT-like shape list on ``cuda:0``.
Figures are medians over ``--repeats`` rounds (after one warm-up save of each kind):

  floor        copy of every tensor into an already-allocated pinned host buffer of the
               same size (non_blocking, then synchronize): the least a save can block.
  unickpt      ``unickpt.save_async(...)`` call (copies into its reused
               shared-memory staging buffer, registered as pinned memory).
  unickpt O1   the same with ``options=unickpt.SaveOptions(compression=unickpt.Compression(
               quant="O1"))`` (quantization runs in the writer process: the call should cost
               the same).
  dcp          ``dcp.async_save`` (thread checkpointer, ``DefaultStager`` with pinned and
               shared memory): call + ``staging_completion`` when the API returns one.
  durable      call to committed, unickpt (``h.wait()``) and DCP (``result()``).

Behind compute (``--loop N``, default 300): a loop of N bf16 8192^3 matmuls on the GPU runs
right after the call, as a trainer's next forward and backward would; the copy must be
done before the optimizer update (``wait_staged()``, DCP's ``staging_completion``):

  alone        the loop without a save.
  unickpt bg   ``background_staging=True``: copies on unickpt's own stream after an event on
               the caller's stream (the library's behaviour).
  unickpt bg, default stream   the same with the copies on the legacy default stream (close
               to unickpt before it had a stream of its own, which also waited with
               ``torch.cuda.synchronize``; for the A/B).
  dcp bg       ``dcp.async_save`` with ``DefaultStager`` async staging.
  Columns: loop s (the loop's wall time, call included), slowdown (loop s - alone), blocking
  (the call + the wait for the copy after the loop).

Loads (``--parts load``): the same state saved once by each library (sync, fsync), then
loaded back, warm (page cache) and cold (fsync + ``POSIX_FADV_DONTNEED``), ABBA order:

  floor        copy of every tensor from a pinned host buffer to the device.
  unickpt cpu  ``unickpt.load`` into host tensors (the same load without the device).
  unickpt gpu  ``unickpt.load`` into the device tensors.
  dcp gpu      ``dcp.load`` into the device tensors.
  Every load is checked bit-exact against the state in its first round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import unickpt


def shapes(gb: float, hidden: int = 2048):
    per_layer = 12 * hidden * hidden
    n_layers = max(1, int(gb * 2**30 / 12 / per_layer))  # 3 fp32 tensors per parameter
    out = [(50304, hidden)]
    for _ in range(n_layers):
        out += [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden), (hidden,), (hidden,)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--loop", type=int, default=300)
    ap.add_argument("--parts", default="save,compute,load", help="comma-separated: save, compute, load")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device("cuda:0")
    sh = shapes(args.gb)
    state = {"model": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for i, s in enumerate(sh):
        state["model"][f"t{i}"] = torch.randn(s, device=dev)
        state["optimizer"]["exp_avg"][f"t{i}"] = torch.randn(s, device=dev) * 1e-3
        state["optimizer"]["exp_avg_sq"][f"t{i}"] = torch.rand(s, device=dev) * 1e-6
    tensors = [t for d in (state["model"], state["optimizer"]["exp_avg"], state["optimizer"]["exp_avg_sq"]) for t in d.values()]
    nbytes = sum(t.numel() * 4 for t in tensors)
    root = args.dir or tempfile.mkdtemp(prefix="unickpt-cuda-")
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def floor():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p, t in zip(pinned, tensors):
            p.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def ours(i, quant=None):
        opts = unickpt.SaveOptions(compression=unickpt.Compression(quant=quant)) if quant else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = unickpt.save_async(state, os.path.join(root, f"u{i}-{quant or 'O0'}"), options=opts)
        blocking = time.perf_counter() - t0
        h.wait()
        return blocking, time.perf_counter() - t0

    dcp_note = ""

    def dcp(i):
        import torch.distributed.checkpoint as dcp_
        from torch.distributed.checkpoint import FileSystemWriter

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(True, True, True, True))
            resp = dcp_.async_save(state, storage_writer=FileSystemWriter(os.path.join(root, f"d{i}"), sync_files=True),
                                   async_stager=stager)
        except (ImportError, TypeError):
            resp = dcp_.async_save(state, storage_writer=FileSystemWriter(os.path.join(root, f"d{i}"), sync_files=True))
        staging = getattr(resp, "staging_completion", None)
        if staging is not None:
            staging.result()
        blocking = time.perf_counter() - t0
        (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
        return blocking, time.perf_counter() - t0

    if "save" in parts:
        floor()
        ours(-1)
        ours(-2, quant="O1")
        try:
            dcp(-1)
        except Exception as e:  # report, do not hide
            dcp_note = f"DCP async_save failed: {type(e).__name__}: {e}"
        rows: dict[str, list] = {"floor": [], "unickpt": [], "unickpt O1": [], "dcp": []}
        for i in range(args.repeats):
            rows["floor"].append((floor(), 0.0))
            rows["unickpt"].append(ours(i))
            rows["unickpt O1"].append(ours(i, quant="O1"))
            if not dcp_note:
                rows["dcp"].append(dcp(i))
            for d in os.listdir(root):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in rows.items() if v}
        print(f"GPU state {nbytes / 1e9:.2f} GB ({torch.cuda.get_device_name(0)}), medians of {args.repeats}")
        print(f"{'':<12}{'blocking s':>12}{'GB/s':>8}{'x floor':>9}{'x DCP':>8}{'durable s':>11}")
        f = med["floor"][0]
        for k, (b, d) in med.items():
            xd = f"{b / med['dcp'][0]:.2f}" if "dcp" in med else "-"
            print(f"{k:<12}{b:>12.3f}{nbytes / b / 1e9:>8.2f}{b / f:>9.2f}{xd:>8}{(f'{d:.2f}' if d else '-'):>11}")
        if dcp_note:
            print(dcp_note)
    if "compute" in parts:
        behind_compute(state, root, args, dcp_note)
    if "load" in parts:
        loads(state, root, args)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def behind_compute(state, root: str, args, dcp_note: str) -> None:
    import unickpt.async_save as a

    dev = torch.device("cuda:0")
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def loop():
        y = x
        for _ in range(args.loop):
            y = x @ x
        return y

    def alone(i):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, 0.0

    def ours(i, default_stream=False):
        ck = a.checkpointer(None)
        if default_stream:
            ck._streams[dev] = torch.cuda.default_stream(dev)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = unickpt.save_async(state, os.path.join(root, f"bg{'d' if default_stream else 's'}{i}"),
                                   background_staging=True)
            call = time.perf_counter() - t0
            loop()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            h.wait_staged()
            blocking = call + time.perf_counter() - t1
            looped = t1 - t0
            h.wait()
            return looped, blocking
        finally:
            ck._streams.pop(dev, None)

    def dcp_bg(i):
        import torch.distributed.checkpoint as dcp_
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        resp = dcp_.async_save(state, storage_writer=FileSystemWriter(os.path.join(root, f"dbg{i}"), sync_files=True),
                               async_stager=DefaultStager(StagingOptions(True, True, True, True)))
        call = time.perf_counter() - t0
        loop()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if getattr(resp, "staging_completion", None) is not None:
            resp.staging_completion.result()
        blocking = call + time.perf_counter() - t1
        looped = t1 - t0
        (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
        return looped, blocking

    variants = {"alone": alone, "unickpt bg": ours, "unickpt bg, default stream": lambda i: ours(i, True)}
    if not dcp_note:
        variants["dcp bg"] = dcp_bg
    rows: dict[str, list] = {k: [] for k in variants}
    for f in variants.values():  # warm-up
        f(-1)
    for i in range(args.repeats):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))  # ABBA
        for k in order:
            rows[k].append(variants[k](i))
        for d in os.listdir(root):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    base = statistics.median(r[0] for r in rows["alone"])
    print(f"behind compute: {args.loop} bf16 8192^3 matmuls after the call, medians of {args.repeats}")
    print(f"{'':<28}{'loop s':>9}{'slowdown s':>12}{'blocking s':>12}")
    for k, v in rows.items():
        lp, bl = statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)
        print(f"{k:<28}{lp:>9.3f}{lp - base:>12.3f}{bl:>12.3f}")


def loads(state, root: str, args) -> None:
    import sys

    import torch.distributed.checkpoint as dcp_
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._common import make_cold

    u, d = os.path.join(root, "load-u"), os.path.join(root, "load-d")
    unickpt.save(state, u)
    dcp_.save(state, storage_writer=FileSystemWriter(d, sync_files=True))

    def like(device):
        return {"model": {k: torch.empty_like(v, device=device) for k, v in state["model"].items()},
                "optimizer": {m: {k: torch.empty_like(v, device=device) for k, v in state["optimizer"][m].items()}
                              for m in ("exp_avg", "exp_avg_sq")}}

    def flat(sd):
        return [sd["model"][k] for k in sd["model"]] + [sd["optimizer"][m][k] for m in ("exp_avg", "exp_avg_sq")
                                                       for k in sd["optimizer"][m]]

    src = flat(state)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    pinned = [t.cpu().pin_memory() for t in src]
    gpu, cpu = like(src[0].device), like("cpu")

    def timed(fn, path, cold, check):
        if cold:
            make_cold([path])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if check is not None:
            bad = sum(not torch.equal(a.cpu(), b) for a, b in zip(flat(check), pinned))
            assert bad == 0, f"{bad} tensors differ after the load"
        return dt

    def floor(cold, check):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for g, p in zip(flat(gpu), pinned):
            g.copy_(p, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    variants = {
        "unickpt cpu": lambda cold, check: timed(lambda: unickpt.load(cpu, u), u, cold, check and cpu),
        "unickpt gpu": lambda cold, check: timed(lambda: unickpt.load(gpu, u), u, cold, check and gpu),
        "dcp gpu": lambda cold, check: timed(lambda: dcp_.load(gpu, storage_reader=FileSystemReader(d)), d, cold,
                                             check and gpu),
    }
    rows: dict = {("floor", False): [], **{(k, c): [] for k in variants for c in (False, True)}}
    for i in range(args.repeats):
        rows[("floor", False)].append(floor(False, None))
        order = list(variants) if i % 2 == 0 else list(reversed(variants))  # ABBA
        for cold in (True, False):
            for k in order:
                rows[(k, cold)].append(variants[k](cold, i == 0 or None))
    print(f"loads: {nbytes / 1e9:.2f} GB, medians of {args.repeats}")
    print(f"{'':<32}{'s':>8}{'GB/s':>8}{'x DCP gpu':>11}")
    for (k, cold), v in rows.items():
        m = statistics.median(v)
        ref = rows.get(("dcp gpu", cold))
        xd = f"{m / statistics.median(ref):.2f}" if ref and k != "floor" else "-"
        name = k if k == "floor" else f"{k}, {'cold' if cold else 'warm'}"
        print(f"{name:<32}{m:>8.3f}{nbytes / m / 1e9:>8.2f}{xd:>11}")


if __name__ == "__main__":
    main()
