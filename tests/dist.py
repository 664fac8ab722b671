"""Run a function on N real processes joined by a gloo process group over 127.0.0.1.

No fake process groups: each rank is its own process (forkserver with torch preloaded, so a
rank starts in well under a second), with a free TCP port per job. Exceptions on any rank
fail the test with that rank's traceback; a hung job is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable, Collection

_CTX = None

#: imported once by the forkserver, so that no rank of any job imports them again: a rank that
#: calls ``torch.use_deterministic_algorithms`` imports torch._inductor (and dynamo, sympy:
#: ~1.5-2.3 s on a CI core, per rank and job), the FSDP2 tests transformers' Llama (~1.4 s), the
#: quantizing tests numba's first dispatch of the fused kernels (~0.9 s: tests/warm_codecs.py)
PRELOAD = ["torch", "torch.distributed", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "transformers.models.llama.modeling_llama", "psutil", "unickpt", "unickpt.train",
           "unickpt.saving.pipeline", "unickpt.loading", "unickpt.async_save", "tests.warm_codecs"]


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def serve_store():
    """A job's rendezvous, a TCP store served by this (the parent) process on a port the
    kernel gives it at bind time; the ranks (:func:`_worker`) are its clients. Keep it
    until the job ends."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


def shm_left_by(pids) -> list[str]:
    """unickpt's /dev/shm segments created by processes ``pids`` (the name carries the
    creator's pid), which have exited. Only this test's own: other jobs on the machine (a
    second test run, another test worker, a benchmark) hold theirs, live or about to be swept,
    and a global "none at all" failed with them."""
    import re

    out = []
    for p in glob.glob("/dev/shm/unickpt-*"):
        m = re.match(r"^unickpt-[a-z]+-([0-9]+)-[0-9a-f]{16}$", os.path.basename(p))  # (unickpt.shm.new_name)
        if m and int(m.group(1)) in pids:
            out.append(p)
    return out


def free_port() -> int:
    """A port free now (for a launcher such as torchrun that binds it itself, later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def waited_out(message: str) -> bool:
    """Whether an error ``message`` says that a wait ran out rather than naming a cause: the
    wordings of unickpt's timeouts ("rank(s) ... did not answer within N s", node reads' "did
    not <step> within N s") and of a handle's own limit ("still running after N s"). Tests
    that check a failure reached a rank "at once" assert it did not (instead of timing it)."""
    import re

    return bool(re.search(r"did not .{1,60}? within [0-9.e+]+ s|still running after [0-9.e+]+ s", message))


def apply_env(env: dict, environ=None) -> dict:
    """Set ``env`` in ``environ`` (default ``os.environ``); a value of None removes the
    variable (so a job's environment can also take variables away, e.g. the discovery
    variables of tests.s3server.offline_env). Returns the values it replaced (None: was not
    set), which ``apply_env`` puts back."""
    environ = os.environ if environ is None else environ
    before = {k: environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = str(v)
    return before


def _worker(fn, rank, world, port, args, q, env, backend="gloo"):
    apply_env(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False)  # served by run(), the parent
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        q.put((rank, True, out))
    except BaseException as e:  # report every failure to the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run(fn: Callable, world: int, *args: Any, timeout: float = 180, env: dict | None = None,
        backend: str = "gloo", may_die: Collection[int] = ()) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the results by rank.
    ``backend="nccl"``: every rank on GPU 0 (one GPU: world 1 only). Ranks in ``may_die``
    may exit without a result (a test that kills them): theirs is None. ``env``: set in each
    rank's environment (None: removed). ``timeout``: a hang guard, not a measurement."""
    ctx = _ctx()
    q = ctx.Queue()
    store = serve_store()  # held until the job ends: no port is picked, let go and bound again by a rank
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, args, q, dict(env or {}), backend))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        def gone() -> set[int]:
            return {r for r in may_die if procs[r].exitcode not in (None, 0) and r not in results}

        while len(results) + len(errors) + len(gone()) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:
                    break
                raise TimeoutError(f"distributed job timed out after {timeout}s; finished ranks {sorted(results)}")
            try:
                rank, ok, out = q.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [p for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in may_die]
                if dead and q.empty():
                    raise RuntimeError(f"rank process died: exit codes {[p.exitcode for p in procs]}")
                continue
            if ok:
                results[rank] = out
            else:
                errors.append(f"rank {rank}: {out}")
                deadline = min(deadline, time.monotonic() + 20)  # peers may be stuck waiting
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(world)]


def kill_tree(procs) -> None:
    """SIGKILL every process of a job at once (``subprocess.Popen``s and all their
    descendants: launchers, ranks, asynchronous writers), then reap the Popens."""
    import signal

    import psutil

    victims = []
    for p in procs:
        try:
            victims += [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
