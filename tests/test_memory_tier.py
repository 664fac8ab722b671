"""The in-memory tier (docs/memory_tier.md): snapshots every step in node memory, replicated
to a peer node, recovery and resharding from memory.

Two kinds of jobs, both on this one machine:
* real multi-node launches: two torchrun agents (``--nnodes 2 --node-rank 0|1``, static
  rendezvous on 127.0.0.1 at a free port) running ``examples/train.py``, each node with its
  own memory directory under /dev/shm; the whole job killed with SIGKILL mid-run;
* quicker jobs of gloo processes whose node is set by ``UNICKPT_NODE_ID`` (tests/dist.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests import dist
from tests.test_trainer import STEPS, _close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- real torchrun agents ------------------------------------------------------------------

TRAIN = ["--steps", "12", "--save-every", "5", "--zero-stage", "2", "--hidden", "64", "--layers", "2", "--heads", "4",
         "--seq-len", "64", "--global-batch", "8", "--micro-batch", "2", "--log-every", "100",
         "--memory-wait"]  # a snapshot of every step (the default skips those due while one is written)


def _agents(tmp, nnodes: int, nproc: int, args: list[str], mem: str | None, metrics: str):
    """Start ``nnodes`` torchrun agents (node ranks 0..), each with its own memory directory
    ``mem/agent{i}``; returns the Popen objects (each in its own session)."""
    port = dist.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "UNICKPT_TIMEOUT_S": "60"}
    procs = []
    for i in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(i),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.join(ROOT, "examples", "train.py"), *args, "--ckpt-dir", os.path.join(tmp, "durable"),
               "--metrics-jsonl", metrics]
        if mem is not None:
            cmd += ["--memory-dir", os.path.join(mem, f"agent{i}")]
        log = open(os.path.join(tmp, f"agent{i}-{time.monotonic_ns()}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=tmp, env={**env, "UNICKPT_NODE_ID": f"node{i}"}, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))  # one simulated host each
    return procs


def _wait(procs, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
        assert p.returncode == 0, f"agent exited with {p.returncode}"


def _events(metrics: str) -> list[dict]:
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def _losses(events) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if "loss" in e}


def _committed(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and os.path.isfile(os.path.join(root, n, "unickpt.json")))


def test_whole_job_killed_resumes_from_memory_then_from_a_replica_on_one_node(tmp_path, shm):
    tmp = str(tmp_path)
    ref_metrics = os.path.join(tmp, "ref.jsonl")
    _wait(_agents(tmp, 2, 2, TRAIN, None, ref_metrics))
    ref = _losses(_events(ref_metrics))
    assert sorted(ref) == list(range(1, 13))
    shutil.rmtree(os.path.join(tmp, "durable"), ignore_errors=True)

    # 2 nodes x 2 ranks, a snapshot every step, durable every 5 steps; SIGKILL mid-run
    metrics = os.path.join(tmp, "run.jsonl")
    procs = _agents(tmp, 2, 2, TRAIN, shm, metrics)
    deadline = time.monotonic() + 240
    while not any(e.get("event") == "save" and e.get("tier") == "memory" and e["step"] >= 7 for e in _events(metrics)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job ended before step 7"
        time.sleep(0.02)
    dist.kill_tree(procs)
    durable = _committed(os.path.join(tmp, "durable"))
    mem = {i: _committed(os.path.join(shm, f"agent{i}", f"node{i}")) for i in (0, 1)}
    newest = max(set(mem[0]) & set(mem[1]))
    assert durable and newest > max(durable) and newest >= 7, (durable, mem)
    assert len(mem[0]) <= 3  # newest 2 kept (+1 possibly mid-rotation)
    backup = os.path.join(shm, "backup")
    shutil.copytree(os.path.join(shm, "agent0"), backup, symlinks=True)

    # same 2 x 2 layout: resumes from the newest memory step, bit-identical losses
    m2 = os.path.join(tmp, "resume.jsonl")
    _wait(_agents(tmp, 2, 2, TRAIN + ["--resume"], shm, m2))
    ev = _events(m2)
    load = [e for e in ev if e.get("event") == "load"]
    assert load and load[0]["tier"] == "memory" and load[0]["step"] == newest, load
    got = _losses(ev)
    assert sorted(got) == list(range(newest + 1, 13))
    assert all(got[s] == ref[s] for s in got), (got, ref)
    assert not os.path.exists(os.path.join(shm, "agent0", "node0"))  # the clean shutdown freed the memory

    # node 1 lost: one node, 2 ranks, ZeRO-1 x TP 2, from node 0's copies of node 1's files
    shutil.rmtree(os.path.join(shm, "agent0"), ignore_errors=True)
    shutil.rmtree(os.path.join(shm, "agent1"), ignore_errors=True)
    shutil.copytree(backup, os.path.join(shm, "agent0"), symlinks=True)
    shutil.rmtree(os.path.join(tmp, "durable"))
    os.makedirs(os.path.join(tmp, "durable"))
    m3 = os.path.join(tmp, "one-node.jsonl")
    args = [a for a in TRAIN] + ["--resume", "--tp", "2"]
    args[args.index("--zero-stage") + 1] = "1"
    _wait(_agents(tmp, 1, 2, args, shm, m3))
    ev = _events(m3)
    load = [e for e in ev if e.get("event") == "load"]
    assert load and load[0]["tier"] == "memory" and load[0]["step"] == newest, load
    got = _losses(ev)
    _close([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)])


# -- simulated nodes (UNICKPT_NODE_ID) ----------------------------------------------------

def _on_nodes(rank, world, nodes, stage, tp, steps, d, mem, save_at, resume, kw=None, metrics=None):
    os.environ["UNICKPT_NODE_ID"] = nodes[rank]
    from tests.test_trainer import _train

    import unickpt.train.trainer as T

    if metrics and rank == 0:
        real = T.Trainer._emit

        def emit(self, rec):  # the events, for the test to read
            with open(metrics, "a") as f:
                f.write(json.dumps(rec) + "\n")
            real(self, rec)

        T.Trainer._emit = emit
    try:
        return _train(rank, world, stage, tp, steps, d, save_at, resume,
                      ckpt_kw={"memory_dir": mem, "memory_skip_busy": False, **(kw or {})})
    except Exception as e:
        return type(e).__name__, str(e)[:3000]


def _flip_newest(mem: str) -> int:
    """Flip one bit of a data file of the newest snapshot, in every node's copy."""
    steps = {}
    for n in os.listdir(mem):
        for s in _committed(os.path.join(mem, n)):
            steps.setdefault(s, []).append(os.path.join(mem, n, f"step-{s:08d}"))
    newest = max(steps)
    for d in steps[newest]:
        f = sorted(x for x in os.listdir(d) if x.startswith("master-"))[0]
        with open(os.path.join(d, f), "r+b") as fh:
            fh.seek(os.path.getsize(os.path.join(d, f)) - 9)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 1]))
    return newest


def test_damaged_newest_snapshot_falls_back_to_the_previous_step(tmp_path, shm, uninterrupted_losses):
    d = str(tmp_path / "ck")
    nodes = ["n0", "n0", "n1", "n1"]
    dist.run(_on_nodes, 4, nodes, 2, 1, 5, d, shm, 4, False)
    newest = _flip_newest(shm)
    assert newest == 5
    metrics = str(tmp_path / "m.jsonl")
    out = dist.run(_on_nodes, 4, nodes, 2, 1, STEPS, d, shm, 4, True, None, metrics)
    load = [e for e in _events(metrics) if e.get("event") == "load"]
    assert load == [dict(load[0], tier="memory", step=4)], load  # step 5 is damaged: step 4, from memory
    _close(out[0][0], uninterrupted_losses[4:])


def test_both_nodes_lost_resumes_from_the_durable_tier(tmp_path, shm, uninterrupted_losses):
    d = str(tmp_path / "ck")
    dist.run(_on_nodes, 4, ["n0", "n0", "n1", "n1"], 2, 1, 5, d, shm, 2, False)
    shutil.rmtree(shm)
    os.makedirs(shm)
    metrics = str(tmp_path / "m.jsonl")
    out = dist.run(_on_nodes, 2, ["n0", "n1"], 3, 1, STEPS, d, shm, 2, True, None, metrics)
    load = [e for e in _events(metrics) if e.get("event") == "load"]
    assert [(e["tier"], e["step"]) for e in load] == [("durable", 4)]
    _close(out[0][0], uninterrupted_losses[4:])


def test_memory_budget_too_small_is_a_typed_error_before_training(tmp_path, shm):
    out = dist.run(_on_nodes, 2, ["n0", "n1"], 1, 1, 3, str(tmp_path / "ck"), shm, 2, False, {"memory_budget": 1 << 16})
    for name, msg in out:
        assert name in ("MemoryBudgetError", "DistributedError"), (name, msg)
    assert any(n == "MemoryBudgetError" and "needs" in m and "of copies from 1 other node(s)" in m for n, m in out), out
    assert not os.path.exists(tmp_path / "ck" / "step-00000001")


def test_replicas_are_listed_in_the_manifest_and_old_snapshots_rotate(tmp_path, shm):
    import unickpt

    d = str(tmp_path / "ck")
    dist.run(_on_nodes, 4, ["n0", "n0", "n1", "n1"], 1, 1, 4, d, shm, 0, False, {"memory_keep": 2})
    for n in ("n0", "n1"):
        assert _committed(os.path.join(shm, n)) == [3, 4]
    _, man = unickpt.read_manifest(os.path.join(shm, "n0", "step-00000004"))
    for f, fe in man.files.items():
        assert fe.replicas == (("n1",) if fe.node == "n0" else ("n0",)), (f, fe)
        assert os.path.isfile(os.path.join(shm, "n0", "step-00000004", f))
        assert os.path.isfile(os.path.join(shm, "n1", "step-00000004", f))


def _close_after(rank, world, nodes, d, mem):
    os.environ["UNICKPT_NODE_ID"] = nodes[rank]
    import torch

    from unickpt.train import LlamaConfig, OptimConfig, TextData, Trainer, UnifiedCheckpoint

    torch.use_deterministic_algorithms(True)
    t = Trainer(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2), TextData(seq_len=32, max_bytes=1 << 20, seed=1),
                optim=OptimConfig(lr=1e-2, warmup=2, total_steps=STEPS),
                checkpoint=UnifiedCheckpoint(dir=d, every=0, memory_dir=mem), global_batch=8, micro_batch=2)
    t.fit(3)
    t.close()
    return t.step


def test_clean_shutdown_frees_host_memory_and_keeps_the_state_durable(tmp_path, shm):
    d = str(tmp_path / "ck")
    assert dist.run(_close_after, 2, ["n0", "n1"], d, shm) == [3, 3]
    assert not os.listdir(shm)  # every node's snapshots and directory gone
    assert _committed(d) == [3]  # the newest state was not only in memory


def _steps_then(rank, world, d, mem, steps, resume, close):
    os.environ["UNICKPT_NODE_ID"] = "n0"
    import torch

    from unickpt.train import LlamaConfig, OptimConfig, TextData, Trainer, UnifiedCheckpoint

    torch.use_deterministic_algorithms(True)
    t = Trainer(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2), TextData(seq_len=32, max_bytes=1 << 20, seed=1),
                optim=OptimConfig(lr=1e-2, warmup=2, total_steps=STEPS),
                checkpoint=UnifiedCheckpoint(dir=d, every=2, memory_dir=mem, memory_every=3, memory_skip_busy=False),
                global_batch=8, micro_batch=2, resume="auto" if resume else None)
    t.fit(steps)
    if close:
        t.close()
    else:
        t.wait_save()
    return t.step


def test_close_after_a_damaged_durable_step_was_skipped_makes_the_resumed_state_durable(tmp_path, shm):
    """Resume skips durable step 4 (damaged) and loads memory step 3; close() must not count
    step 4 as the durable tier's newest: it writes step 3 durable before freeing memory
    (found by an attacker's review: step 3 was freed and existed nowhere)."""
    d = str(tmp_path / "ck")
    assert dist.run(_steps_then, 1, d, shm, 5, False, False) == [5]
    assert _committed(d) == [2, 4] and _committed(os.path.join(shm, "n0")) == [3]
    f = sorted(x for x in os.listdir(os.path.join(d, "step-00000004")) if x.startswith("master-"))[0]
    with open(os.path.join(d, "step-00000004", f), "r+b") as fh:
        fh.seek(-9, 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))
    assert dist.run(_steps_then, 1, d, shm, 3, True, True) == [3]
    assert 3 in _committed(d) and not os.listdir(shm)


def test_clean_memory_command_refuses_a_live_job_and_cleans_a_dead_one(tmp_path, shm):
    from unickpt import memtier

    node = os.path.join(shm, "n0")
    os.makedirs(os.path.join(node, "step-00000001"))
    os.makedirs(os.path.join(node, ".step-00000002.tmp-abc"))
    memtier.write_owner(os.path.join(shm, "{node}").replace("{node}", "n0"), [os.getppid()])  # a live pid
    cli = [sys.executable, "-m", "unickpt.cli", "clean-memory", node]
    r = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "running job" in r.stderr, r
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    memtier.write_owner(node, [p.pid])  # the job is gone
    r = subprocess.run(cli + ["--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r
    assert len(json.loads(r.stdout)["removed"]) == 2
    assert not os.path.exists(node)


def _slow_writers(rank, world, *args):
    """The writer processes of this rank take 0.5 s more per save (parked once their data is written)."""
    from tests import faulty

    faulty.mark_fault_points()  # in the writers this rank starts
    os.environ["FAULTY_PARK"] = "after-data:0.5"  # which inherit it
    return _on_nodes(rank, world, *args)


def test_a_busy_writer_skips_snapshots_and_never_a_durable_checkpoint(tmp_path, shm):
    """Writers slowed down (0.5 s per save): with the default memory_skip_busy the snapshots
    due meanwhile are skipped (reported), the loop does not wait for them, and the durable
    checkpoint due at step 4 is still written."""
    d = str(tmp_path / "ck")
    metrics = str(tmp_path / "m.jsonl")
    out = dist.run(_slow_writers, 2, ["n0", "n1"], 1, 1, 5, d, shm, 4, False, {"memory_skip_busy": True}, metrics)
    assert all(isinstance(o[0], list) for o in out), out
    ev = _events(metrics)
    skipped = [e["step"] for e in ev if e.get("event") == "snapshot_skipped"]
    saved = [(e["tier"], e["step"]) for e in ev if e.get("event") == "save"]
    assert skipped and ("durable", 4) in saved and ("memory", 4) in saved, (skipped, saved)
    assert not set(skipped) & {s for t, s in saved if t == "memory"}
    assert _committed(d) == [4]


def _rank_1_always_busy(rank, world, *args):
    """At every snapshot due, rank 1's previous save looks still busy and rank 0's looks done
    (its handle says so; the snapshot then waits for it to be committed, as it always does)."""
    import unickpt.async_save as A

    A.AsyncSave.done = (lambda self: False) if rank == 1 else (lambda self: True)
    return _on_nodes(rank, world, *args)


def test_a_snapshot_is_skipped_by_every_rank_or_by_none(tmp_path, shm, monkeypatch):
    """A snapshot is a collective save. Each rank's handle finishes at its own moment, so a
    rank deciding alone to skip while another saved left both waiting out timeout_s; the
    ranks now skip together when any of them is busy."""
    monkeypatch.setenv("UNICKPT_TIMEOUT_S", "20")  # a divergence fails in 20 s, not 600
    d = str(tmp_path / "ck")
    metrics = str(tmp_path / "m.jsonl")
    out = dist.run(_rank_1_always_busy, 2, ["n0", "n1"], 1, 1, 5, d, shm, 4, False, {"memory_skip_busy": True},
                   metrics, timeout=120)
    assert all(isinstance(o[0], list) for o in out), out
    ev = _events(metrics)
    skipped = [e["step"] for e in ev if e.get("event") == "snapshot_skipped"]
    saved = [(e["tier"], e["step"]) for e in ev if e.get("event") == "save"]
    # rank 0's writer was never busy: it skipped only because rank 1's was
    assert skipped and ("durable", 4) in saved, (skipped, saved)
    assert not set(skipped) & {s for t, s in saved if t == "memory"}


def test_replicas_that_cannot_be_made_are_refused_before_anything_is_written(tmp_path):
    import torch

    import unickpt
    from unickpt.errors import InvalidArgumentError

    sd = {"model": {"w": torch.ones(4, 4)}}
    with pytest.raises(InvalidArgumentError, match="node-local"):
        unickpt.save(sd, str(tmp_path / "plain" / "step-00000001"), replicas=1)
    with pytest.raises(InvalidArgumentError, match="spans 1 node"):  # one node: nobody to hold a copy
        unickpt.save(sd, str(tmp_path / "{node}" / "step-00000001"), replicas=1)
    assert not (tmp_path / "plain").exists()
    assert all(not os.listdir(d) for d in tmp_path.iterdir() if d.is_dir())


def _replicate_with_a_failing_read(rank, world, root, fail_rank):
    os.environ["UNICKPT_NODE_ID"] = ["n0", "n1"][rank]
    import torch

    import unickpt
    from unickpt.io import local

    if fail_rank in (rank, "all"):  # this rank's files cannot be read back for their replicas
        def broken(self, offset, n):
            raise OSError(5, "injected read error")
        local._Reader.mapped = broken
    sd = {"model": {"w": unickpt.shard(torch.full((1 << 20,), float(rank)), (2 << 20,), offsets=(rank << 20,))}}
    try:
        unickpt.save(sd, os.path.join(root, "{node}", "step-00000001"), options=unickpt.SaveOptions(replicas=1))
    except Exception as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("fail_rank", [0, "all"])  # (rank 0 writes the one file of this state)
def test_a_replica_that_cannot_be_read_back_fails_the_save_on_every_rank(tmp_path, fail_rank):
    out = dist.run(_replicate_with_a_failing_read, 2, str(tmp_path), fail_rank, timeout=120)
    assert all(o is not None for o in out), out  # nobody went on alone, nobody hangs
    assert any("injected read error" in o[1] for o in out), out
    for n in ("n0", "n1"):
        assert _committed(str(tmp_path / n)) == []  # nothing committed on either node
