"""examples/own_loop.py, as a user runs it: FSDP2 over a transformers Llama on 2 ranks with
``UnifiedCheckpoint`` (async, memory tier, keep 2); the whole job killed with SIGKILL after a
save; resumed on 2 ranks (losses bit-identical to an uninterrupted run), stopped without
closing, and resumed again on 1 rank (the same losses up to the reduction order)."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests import dist

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "own_loop.py")
ARGS = ["--steps", "10", "--every", "3", "--hidden", "32", "--seq-len", "16"]


def _start(tmp, name, ranks, ckdir, mem, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "UNICKPT_TIMEOUT_S": "60"}
    cmd = [SCRIPT, *ARGS, "--dir", ckdir, "--memory-dir", mem, *extra]
    if ranks > 1:
        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(dist.free_port()), *cmd]
    out = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen([sys.executable, *cmd], cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _lines(tmp, name):
    with open(os.path.join(tmp, f"{name}.log")) as f:
        text = f.read()
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out, text


def _finish(p, tmp, name, timeout=300):
    p.wait(timeout=timeout)
    lines, text = _lines(tmp, name)
    assert p.returncode == 0, text[-3000:]
    return lines, text


def _losses(lines):
    return {x["step"]: x["loss"] for x in lines if "loss" in x}



def test_own_loop_survives_kill_9_and_resumes_on_2_and_1_ranks(tmp_path, shm):
    tmp = str(tmp_path)
    ref_lines, _ = _finish(_start(tmp, "ref", 2, os.path.join(tmp, "ref"), os.path.join(shm, "ref")), tmp, "ref")
    ref = _losses(ref_lines)
    assert sorted(ref) == list(range(1, 11))

    ck, mem = os.path.join(tmp, "ck"), os.path.join(shm, "run")
    p = _start(tmp, "a", 2, ck, mem)
    deadline = time.monotonic() + 300
    while True:  # SIGKILL to the whole job (agent, ranks, writer processes) once step 3 is durable
        lines, text = _lines(tmp, "a")
        if any(x.get("event") == "save" and x.get("tier") == "durable" and x["step"] == 3 for x in lines):
            break
        assert p.poll() is None and time.monotonic() < deadline, text[-3000:]
        time.sleep(0.05)
    dist.kill_tree([p])
    killed_at = max(_losses(lines))

    lines, _ = _finish(_start(tmp, "b", 2, ck, mem, "--stop-at", "8"), tmp, "b")
    loads = [x for x in lines if x.get("event") == "load"]
    assert len(loads) == 1 and 3 <= loads[0]["step"] <= killed_at, lines
    got = _losses(lines)
    assert sorted(got) == list(range(loads[0]["step"] + 1, 9))
    assert all(got[s] == ref[s] for s in got), (got, ref)  # bit-identical: the same layout

    lines, text = _finish(_start(tmp, "c", 1, ck, mem), tmp, "c")  # one rank, from the 2-rank state
    loads = [x for x in lines if x.get("event") == "load"]
    assert loads and loads[0]["step"] == 8 and loads[0]["tier"] == "memory", lines
    got = _losses(lines)
    assert sorted(got) == [9, 10]
    assert all(abs(got[s] - ref[s]) <= 1e-4 * abs(ref[s]) for s in got), (got, ref)
    assert "done: 1 rank(s)" in text
    steps = sorted(int(n[5:]) for n in os.listdir(ck) if n.startswith("step-"))
    assert steps == [9, 10], steps  # keep=2; close() made the last step durable
    left = [d for d, _, _ in os.walk(os.path.join(shm, "run")) if os.path.basename(d).startswith("step-")]
    assert not left, left  # close() freed the memory tier
