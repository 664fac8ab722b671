"""Findings of the hostile review of the memory tier (#14), kept as tests: each failed on the
code as first written (the docstring says what happened) and passes with its fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import unickpt
from tests import dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ckpt(path, step=1):
    unickpt.save({"model": {"w": torch.arange(16, dtype=torch.float32)}}, path, step=step)


def test_clean_memory_refuses_a_durable_checkpoint_root(tmp_path):
    """`unickpt clean-memory DIR` removes every `step-*` directory under DIR, committed or not,
    whatever DIR is: pointed at the durable root (a slip of the finger: the same job has
    --ckpt-dir and --memory-dir), it deletes every committed durable checkpoint, with exit 0.
    Expected: refuse (exit 2, nothing removed) a directory that is not a memory-tier
    directory (no owner record / not on tmpfs), or at least one holding committed checkpoints
    unless --force."""
    root = str(tmp_path / "ckpt")
    _ckpt(os.path.join(root, "step-00000001"), 1)
    _ckpt(os.path.join(root, "step-00000002"), 2)
    r = subprocess.run([sys.executable, "-m", "unickpt.cli", "clean-memory", root], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    left = sorted(os.listdir(root)) if os.path.isdir(root) else []
    assert r.returncode == 2 and left == ["step-00000001", "step-00000002"], (r.returncode, r.stdout, r.stderr, left)


def test_clean_memory_with_node_placeholder_finds_a_torchrun_jobs_snapshots(shm, monkeypatch):
    """docs/memory_tier.md tells to run `unickpt clean-memory /dev/shm/<job>/{node}` on every
    node from an epilog. The epilog has no launcher variables; the job's ranks had
    (GROUP_RANK=0): the node id of both is the host name, so `{node}` names the directory the
    job wrote, and the dead job's snapshots are freed."""
    import socket

    from unickpt import memtier

    node = os.path.join(shm, socket.gethostname())  # what a torchrun rank with GROUP_RANK=0 wrote
    os.makedirs(os.path.join(node, "step-00000007"))
    with open(os.path.join(node, "step-00000007", "model-00001.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    memtier.write_owner(node, [p.pid])  # the job is gone
    env = {k: v for k, v in os.environ.items() if k not in ("UNICKPT_NODE_ID", "GROUP_RANK", "SLURM_NODEID")}
    r = subprocess.run([sys.executable, "-m", "unickpt.cli", "clean-memory", os.path.join(shm, "{node}")],
                       capture_output=True, text=True, cwd=ROOT, env={**env, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and not os.path.exists(os.path.join(node, "step-00000007")), (r.returncode, r.stdout,
                                                                                            r.stderr)

    from unickpt.transport import node_id

    monkeypatch.delenv("UNICKPT_NODE_ID", raising=False)
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert node_id() == socket.gethostname()


# -- trainer jobs on simulated nodes --------------------------------------------------------

def _trainer(rank, world, nodes, d, mem, steps, every, resume, close, kw=None):
    os.environ["UNICKPT_NODE_ID"] = nodes[rank]
    import torch

    from unickpt.train import LlamaConfig, OptimConfig, TextData, Trainer, UnifiedCheckpoint

    torch.use_deterministic_algorithms(True)
    try:
        t = Trainer(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2), TextData(seq_len=32, max_bytes=1 << 20, seed=1),
                    optim=OptimConfig(lr=1e-2, warmup=2, total_steps=6),
                    checkpoint=UnifiedCheckpoint(dir=d, every=every, memory_dir=mem, memory_skip_busy=False,
                                                 **{k: v for k, v in (kw or {}).items() if not k.startswith("_")}),
                    global_batch=8, micro_batch=2, resume="auto" if resume else None)
        t.fit(steps)
        if close:
            t.close()
        if kw and kw.pop("_loads", False):
            return t.step, [(e["tier"], e["step"]) for e in t.history if e.get("event") == "load"]
        return t.step
    except Exception as e:
        return type(e).__name__, str(e)[:2000]


def test_close_after_resuming_from_a_snapshot_whose_step_is_also_durable(tmp_path, shm):
    """A job reaches its last step S, where a durable checkpoint is due (written from the
    snapshot), and dies before close() freed the memory. Rerun with resume: the memory
    snapshot of step S is chosen (memory first at equal steps), `_durable_step` stays -1, so
    close() believes the durable tier is behind and saves step S again without overwrite:
    CheckpointExistsError from close(), and the host memory is never freed.
    Expected: close() succeeds (the durable tier already holds step S: take the durable steps
    into account when resuming from memory, or skip/overwrite an existing identical step)
    and the memory directory is emptied."""
    d = str(tmp_path / "ck")
    nodes = ["n0", "n1"]
    assert dist.run(_trainer, 2, nodes, d, shm, 4, 4, False, False) == [4, 4]  # killed before close()
    assert os.path.isdir(os.path.join(d, "step-00000004"))
    out = dist.run(_trainer, 2, nodes, d, shm, 4, 4, True, True)
    assert out == [4, 4], out
    assert not os.listdir(shm), os.listdir(shm)


def _trainer_budget(rank, world, nodes, d, mem, steps):
    from unickpt import memtier

    seen = {}
    real = memtier.check_budget

    def spy(comm, memory_dir, budget, limit=None):
        seen["b"] = budget
        return real(comm, memory_dir, budget, limit)

    memtier.check_budget = spy
    out = _trainer(rank, world, nodes, d, mem, steps, 0, False, False, {"memory_keep": 1})
    b = seen["b"]
    return out, nodes[rank], b.per_snapshot


def _dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def test_memory_budget_holds_for_nodes_with_different_numbers_of_ranks(tmp_path, shm):
    """The budget takes each node's share of a snapshot as stored bytes / nodes. Writers are
    balanced over ranks, so a node with more ranks writes more, and with R=1 the node after
    it holds copies of all of that: nodes [A, A, B, C], R=1: node B holds A's half plus its
    own quarter (3/4 of a checkpoint per snapshot) while the budget reserves 2/3. The check
    passes up front and the tmpfs can then fill mid-training (ENOSPC in the writers), which
    the up-front check exists to prevent.
    Expected: per node, the bytes one snapshot takes there (own files + copies) <= what the
    budget reserved for one snapshot (compute it from the save plan's per-node bytes and the
    replica map, not an even split)."""
    d = str(tmp_path / "ck")
    nodes = ["A", "A", "B", "C"]
    out = dist.run(_trainer_budget, 4, nodes, d, shm, 2)
    assert all(o[0] == 2 for o in out), out
    reserved = {n: r for _, n, r in out}
    held = {n: _dir_bytes(os.path.join(shm, n, "step-00000002")) for n in set(nodes)}
    over = {n: (held[n], reserved[n]) for n in held if held[n] > reserved[n]}
    assert not over, f"one snapshot takes more than the budget reserved (held, reserved): {over}; all held: {held}"


def test_a_damaged_copy_on_one_node_does_not_lose_the_step_that_the_other_node_holds_intact(tmp_path, shm):
    """Nodes n0, n1, R=1: each node holds its own files and a copy of the other's, and a
    node-local load makes every rank read its own node's copy. One bit flipped in n1's *copy*
    of a file n0 wrote (n0's original intact) makes the newest snapshot fail on n1's ranks,
    and the resume falls back a step (here to the durable tier/previous snapshot), although
    an intact copy of every file is in memory. Replication thus halves the snapshot's
    tolerance to damage instead of covering it.
    Expected: resume from step 4 (memory): a checksum failure on one holder's copy retries
    the range from another holder (the manifest lists them) before giving up on the step."""
    d = str(tmp_path / "ck")
    nodes = ["n0", "n1"]
    assert dist.run(_trainer, 2, nodes, d, shm, 4, 0, False, False) == [4, 4]
    snap = os.path.join(shm, "n1", "step-00000004")
    _, man = unickpt.read_manifest(snap)
    name = next(f for f, fe in sorted(man.files.items()) if fe.node == "n0" and f.startswith("model"))
    p = os.path.join(snap, name)
    with open(p, "r+b") as fh:
        fh.seek(os.path.getsize(p) - 5)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))
    out = dist.run(_trainer, 2, nodes, d, shm, 5, 0, True, False, {"_loads": True})
    assert out[0] == (5, [("memory", 4)]), out


def _close_then_look(rank, world, nodes, d, mem):
    out = _trainer(rank, world, nodes, d, mem, 2, 0, False, True)
    mine = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"unickpt-{os.getpid()}-"))
    return out, mine


def test_close_frees_the_staging_memory_too(tmp_path, shm):
    """Issue #14: "Nothing left in host memory after a clean shutdown". Trainer.close()
    removes the snapshots, but each rank's shared-memory staging segment (a full copy of the
    rank's state, in /dev/shm) stays until the process exits: a trainer that goes on living
    after close() (evaluation, a notebook, the next job in the same process) keeps
    local-state-sized tmpfs pages per rank.
    Expected: close() shuts down the writers and unlinks the staging (unickpt.async_save.shutdown)."""
    out = dist.run(_close_then_look, 2, ["n0", "n1"], str(tmp_path / "ck"), shm)
    assert all(o[0] == 2 for o in out), out
    assert not os.listdir(shm)
    assert all(not o[1] for o in out), f"staging segments left after close(): {out}"


def test_resume_never_takes_another_jobs_snapshots(tmp_path, shm):
    """Job 1 (durable dir ck1) dies at step 3 leaving snapshots in the memory directory.
    Job 2, a different run (its own, empty, durable dir ck2) that happens to use the same
    --memory-dir (e.g. a site-wide default like /dev/shm/run), started with resume="auto" and
    silently continued from job 1's step 3. Now a memory directory belongs to one job (its
    durable directory, in the owner record and in every snapshot's manifest): job 2 is refused
    with a typed error naming the directory, and job 1's snapshots stay."""
    nodes = ["n0", "n1"]
    assert dist.run(_trainer, 2, nodes, str(tmp_path / "ck1"), shm, 3, 0, False, False) == [3, 3]
    out = dist.run(_trainer, 2, nodes, str(tmp_path / "ck2"), shm, 4, 0, True, False, {"_loads": True})
    assert all(o[0] in ("InvalidArgumentError", "DistributedError") for o in out), out
    assert any(o[0] == "InvalidArgumentError" and "another job" in o[1] and "ck1" in o[1] for o in out), out
    assert sorted(os.listdir(os.path.join(shm, "n0"))) [-2:] == ["step-00000002", "step-00000003"]
    out = dist.run(_trainer, 2, nodes, str(tmp_path / "ck1"), shm, 4, 0, True, False, {"_loads": True})
    assert out[0] == (4, [("memory", 3)]), out  # its own job still resumes from them


def test_memory_budget_of_the_wrong_type_is_refused_up_front(tmp_path):
    """UnifiedCheckpoint validates memory_every/keep/replicas but not memory_budget: "4GiB",
    a float or True are accepted, and the trainer later fails in check_budget with a bare
    TypeError (not a typed unickpt error, not before... a clear message), or (True) takes 1 byte.
    Expected: ValueError at construction, like the other memory_* fields."""
    from unickpt.train import UnifiedCheckpoint

    for bad in ("4GiB", 1.5e9, True, -1):
        with pytest.raises(ValueError):
            UnifiedCheckpoint(dir=str(tmp_path / "ck"), memory_dir=str(tmp_path / "m"), memory_budget=bad)
