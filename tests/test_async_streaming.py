"""Streamed (background) staging: the writer reads only bytes the copy has passed (an FSDP2
model too); failures during the copy stay typed, bounded, paired across ranks, and say their
real cause; a trainer that dies mid-copy leaves no staging memory."""

import glob
import os
import time

import pytest
import torch

import unickpt
from tests import dist
from tests.test_async import _state
from unickpt.errors import AsyncSaveError



def _mixed(rank, world, rows=512):
    w = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rank))
    return {
        "model": {"w": unickpt.shard(w.to(torch.bfloat16), (rows * world, 40), offsets=(rows * rank, 0))},
        "master": {"w": unickpt.shard(w.clone(), (rows * world, 40), offsets=(rows * rank, 0))},
        "step": 3,
    }


def _master_copy_fails(rank, world, root, master):
    import unickpt.async_save as a

    sd = _mixed(rank, world)
    unickpt.save(sd, os.path.join(root, "step-00000001"), step=1, async_save=True, master=master,
                 timeout_s=60).wait(timeout=120)
    if rank == 1:
        real = a.Checkpointer._copy

        def copy(self, entries, staged, tell=None):
            real(self, entries[:1], staged, tell)
            raise RuntimeError("injected copy failure")

        a.Checkpointer._copy = copy
    # timeout_s=600: past the job's limit (180 s, a hang guard only), so a rank that waited it
    # out could not pass
    h = unickpt.save(sd, os.path.join(root, "step-00000002"), step=2, async_save=True, background_staging=True,
                     master=master, timeout_s=600)
    with pytest.raises(AsyncSaveError) as e:
        h.wait(timeout=120)
    # the writer's own answer (the handle's error; on rank 1 wait() raises the staging error first)
    h._owner._poll(h, timeout=120)
    if rank == 1:
        a.Checkpointer._copy = real
    err = str(h._error) if h._error is not None else str(e.value)
    unickpt.save(sd, os.path.join(root, "step-00000003"), step=3, async_save=True, background_staging=True,
                 master=master, timeout_s=60).wait(timeout=120)  # later saves work
    return err


@pytest.mark.parametrize("master", ["residual", "drop"])
def test_background_copy_failure_with_a_master_policy_keeps_collectives_paired(tmp_path, master):
    """With master != "full" the writer waits for the whole copy before compressing the
    master weights: a rank whose copy fails must still take part in that phase's collective
    (compress.prepare's all-gather), else its agree() pairs with its peers' gather_json and
    the peers fail with a JSON decoding error that names no cause."""
    out = dist.run(_master_copy_fails, 2, str(tmp_path), master)
    for rank, err in enumerate(out):
        assert "injected copy failure" in err, (rank, err)  # the cause, told to every rank
        assert not dist.waited_out(err), (rank, err)  # no rank waits out the timeout
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-00000001", "step-00000003"]


def _die_mid_copy(rank, world, root):
    import signal

    import unickpt.async_save as a
    from unickpt.async_save import staging

    staging.STAGE_CHUNK = 64 << 10
    sd = {"model": {f"w{i}": torch.full((512, 64), float(i)) for i in range(8)}}
    unickpt.save(sd, os.path.join(root, "step-00000001"), step=1, async_save=True).wait(timeout=120)
    c = a.checkpointer()
    with open(os.path.join(root, "pids"), "w") as f:
        f.write(f"{os.getpid()} {c._proc.pid}")
    real = a.Checkpointer._copy

    def copy(self, entries, staged, tell=None):
        def kill(end, done=False):
            tell(end, done)
            time.sleep(0.3)  # the writer is inside the save, waiting for the next bytes
            os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies mid-copy

        real(self, entries, staged, kill)

    a.Checkpointer._copy = copy
    unickpt.save(sd, os.path.join(root, "step-00000002"), step=2, async_save=True, background_staging=True)
    time.sleep(60)


def test_trainer_killed_mid_background_copy_frees_its_staging_memory(tmp_path):
    """The trainer dies while it streams its copy: the gate thread, not the writer's loop,
    sees the pipe close; the writer must still free the dead trainer's segments (as it does
    when its loop reads the closed pipe) rather than exit and leave them in /dev/shm."""
    import psutil

    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="died"):
        dist.run(_die_mid_copy, 1, root, timeout=120)
    trainer, writer = (int(x) for x in open(os.path.join(root, "pids")).read().split())
    deadline = time.monotonic() + 120  # a hang guard only: the writer exits within a second or so
    while psutil.pid_exists(writer) and time.monotonic() < deadline:
        try:
            if psutil.Process(writer).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    left = glob.glob(f"/dev/shm/unickpt-stage-{trainer}-*")
    for p in left:  # (do not leave them to other tests)
        os.unlink(p)
    assert left == []


def _writer_killed_mid_copy(rank, world, root):
    import signal

    import unickpt.async_save as a
    from unickpt.async_save import staging

    staging.STAGE_CHUNK = 64 << 10
    sd = {"model": {f"w{i}": unickpt.shard(torch.full((512, 64), float(i + rank)), (1024, 64), offsets=(512 * rank, 0))
                    for i in range(8)}}
    unickpt.save(sd, os.path.join(root, "step-00000001"), step=1, async_save=True).wait(timeout=120)
    real = a.Checkpointer._copy
    if rank == 1:
        def copy(self, entries, staged, tell=None):
            def kill(end, done=False):
                tell(end, done)
                if not getattr(kill, "done", False):
                    kill.done = True
                    time.sleep(0.3)
                    os.kill(self._proc.pid, signal.SIGKILL)  # this rank's writer dies mid-copy
                    time.sleep(0.3)

            real(self, entries, staged, kill)

        a.Checkpointer._copy = copy
    # timeout_s=600: past the job's limit (180 s, a hang guard only): no rank may wait it out
    h = unickpt.save(sd, os.path.join(root, "step-00000002"), step=2, async_save=True, background_staging=True,
                     timeout_s=600)
    with pytest.raises(AsyncSaveError) as e:
        h.wait(timeout=120)
    a.Checkpointer._copy = real
    unickpt.save(sd, os.path.join(root, "step-00000003"), step=3, async_save=True).wait(timeout=120)
    return str(e.value)


def test_writer_killed_mid_background_copy_says_so(tmp_path):
    out = dist.run(_writer_killed_mid_copy, 2, str(tmp_path))
    for err in out:  # both ranks fail at once, neither waits out a timeout or the wait's limit
        assert not dist.waited_out(err), err
    assert "died" in out[1], out[1]
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-00000001", "step-00000003"]


def _writer_refuses(rank, world, root):
    import unickpt.async_save as a
    from unickpt.async_save import segment, staging

    staging.STAGE_CHUNK = 64 << 10
    sd = {"model": {f"w{i}": torch.full((512, 64), float(i)) for i in range(8)}}
    real_seg, real_copy = a.Checkpointer._ensure_segment, a.Checkpointer._copy

    def ensure(self, size):
        real_seg(self, size)
        os.unlink(os.path.join(segment.SHM_DIR, self._seg.name))  # the writer cannot map it: it answers an error, exits

    def copy(self, entries, staged, tell=None):
        def slow(end, done=False):
            tell(end, done)
            time.sleep(0.1)

        real_copy(self, entries, staged, slow)

    a.Checkpointer._ensure_segment, a.Checkpointer._copy = ensure, copy
    try:
        h = unickpt.save(sd, os.path.join(root, "step-00000001"), step=1, async_save=True, background_staging=True)
        with pytest.raises(AsyncSaveError) as e:
            h.wait(timeout=120)
    finally:
        a.Checkpointer._ensure_segment, a.Checkpointer._copy = real_seg, real_copy
    return str(e.value)


def test_a_writer_error_during_a_background_copy_is_the_error_raised(tmp_path):
    """The writer answers an error and exits while the trainer still streams its copy: the
    trainer's next send breaks, and the error raised must be the writer's (here: it could
    not map the segment), not the broken pipe."""
    (err,) = dist.run(_writer_refuses, 1, str(tmp_path))
    assert "FileNotFoundError" in err or "No such file" in err, err


def _slow_background_copy(rank, world, root):
    """The background copy is held until wait(timeout=0.5) has returned: a wait that did not
    honour its timeout while the copy runs would never return (the job's limit, a hang guard
    only, fails the test)."""
    import threading

    import unickpt.async_save as a

    sd = {"model": {"w": torch.ones(256, 40)}, "step": 1}
    real = a.Checkpointer._copy
    release, copied = threading.Event(), []

    def copy(self, entries, staged, tell=None):
        release.wait(300)
        real(self, entries, staged, tell)
        copied.append(True)

    a.Checkpointer._copy = copy
    h = unickpt.save(sd, os.path.join(root, "step-00000001"), step=1, async_save=True, background_staging=True)
    with pytest.raises(AsyncSaveError, match="still running after 0.5 s"):
        h.wait(timeout=0.5)
    copied_before = bool(copied)
    release.set()  # only now may the copy go on
    a.Checkpointer._copy = real
    return copied_before, h.wait(timeout=120).step


def test_wait_with_a_timeout_also_bounds_a_background_copy(tmp_path):
    copied_before, step = dist.run(_slow_background_copy, 1, str(tmp_path), timeout=120)[0]  # a hang guard only
    # the timeout held while the copy ran (held back until the wait had returned); the save then completed
    assert not copied_before and step == 1


def _fsdp_save_streamed(rank, world, root):
    """FSDP2 Llama (transformers config): an async save with background staging while the
    next steps' forward and backward run; the optimizer step waits for the copy."""
    import unickpt.async_save as a
    from tests.hf_models import fsdp, llama
    from tests.test_semantics import _llama_state, _llama_steps
    from unickpt.async_save import staging

    staging.STAGE_CHUNK = 4096  # the writer is told of every ~4 KiB copied: reads wait inside tensors
    model = fsdp(llama(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _llama_steps(model, opt, 2)
    # writer and staging before the save (after a step: AdamW makes its moments at the first)
    unickpt.start_async_writer({"model": model, "optim": opt})
    seg = a.checkpointer()._seg
    state, groups = _llama_state(model, opt)  # the state at the call
    h = unickpt.save({"model": model, "optim": opt}, os.path.join(root, "llama"), step=2, async_save=True,
                     background_staging=True)
    assert seg is not None and a.checkpointer()._seg is seg  # sized right: the save reused it
    h.wait_staged()  # (a trainer overlaps its forward/backward here; the update must wait)
    losses = _llama_steps(model, opt, 2, seed=11)  # changes every parameter and moment
    assert h.wait(timeout=120).step == 2
    return ({k: v.tolist() for k, v in state.items()}, groups, losses) if rank == 0 else None


def test_fsdp2_llama_saved_with_background_staging_resumes_bit_exact(tmp_path):
    from tests.test_semantics import _fsdp_resume

    root = str(tmp_path)
    want, groups, losses = dist.run(_fsdp_save_streamed, 2, root, timeout=300)[0]
    got, g2, l2, unexpected, missing = _fsdp_resume(0, 1, root)
    assert unexpected == [] and missing == [] and g2 == groups
    assert [k for k in want if got[k] != want[k]] == [] and set(got) == set(want)
    assert l2 == losses  # the resumed run continues exactly as the saving run did


def _streamed(rank, world, root):
    """With background staging, the writer starts while the trainer is still copying, and
    reads only what has arrived: the segment still holds the previous save's values, so a
    read ahead of the copy would store them (with matching checksums)."""
    import unickpt.async_save as a
    from unickpt.async_save import staging

    staging.STAGE_CHUNK = 256 << 10  # the writer is told every 256 KiB copied (each tensor in 4 blocks of rows)
    old = _state(rank, world, scale=64)
    unickpt.save(old, os.path.join(root, "step-00000001"), step=1, async_save=True).wait(timeout=120)
    new = _state(rank, world, scale=64)
    for v in [*new["model"].values(), new["optimizer"]["m"]["w0"]]:
        v.local.mul_(-2).sub_(3)
    real, started = a.Checkpointer._copy, []

    def copy(self, entries, staged, tell=None):
        def slow(end, done=False):
            tell(end, done)
            if not started:  # after the first block: wait (bounded) for the writers' temporary
                deadline = time.monotonic() + 60
                while not glob.glob(os.path.join(root, ".step-00000002.tmp-*")) and time.monotonic() < deadline:
                    time.sleep(0.01)
                started.append(bool(glob.glob(os.path.join(root, ".step-00000002.tmp-*"))))
            time.sleep(0.05)  # the writers run ahead of the copy if they can

        real(self, entries, staged, slow)

    a.Checkpointer._copy = copy
    try:
        h = unickpt.save(new, os.path.join(root, "step-00000002"), step=2, async_save=True, background_staging=True)
        assert h.wait(timeout=120).step == 2
    finally:
        a.Checkpointer._copy = real
    back = _state(rank, world, scale=64)
    for v in [*back["model"].values(), back["optimizer"]["m"]["w0"]]:
        v.local.zero_()
    unickpt.load(back, os.path.join(root, "step-00000002"))
    same = all(torch.equal(x.local, y.local) for x, y in zip([*back["model"].values(), back["optimizer"]["m"]["w0"]],
                                                             [*new["model"].values(), new["optimizer"]["m"]["w0"]]))
    return started, same


def test_a_background_copy_streams_to_the_writer_which_reads_only_copied_bytes(tmp_path):
    out = dist.run(_streamed, 2, str(tmp_path))
    for started, same in out:
        assert started == [True]  # the save's temporary existed while the trainer was still copying
        assert same  # every byte stored is the new state's, none the segment's previous content


def test_a_streamed_copy_tells_the_writer_every_chunk_whatever_the_shape(monkeypatch):
    """Every ~STAGE_CHUNK bytes copied are told to the writer, also inside a tensor of one long
    row (a streamed copy used to cut tensors only between rows: a 1 x N tensor arrived whole,
    and the writer waited for all of it), and each told prefix of the segment holds the state."""
    import unickpt.async_save as a
    from unickpt.async_save import staging
    from unickpt.state import flatten

    monkeypatch.setattr(staging, "STAGE_CHUNK", 64 << 10)
    sd = {"model": {"row": torch.randn(1, 100_000), "col": torch.randn(3, 50_000).t(), "flat": torch.randn(70_000),
                    "scalar": torch.tensor(2.0)}}
    entries, _ = flatten(sd, 0, 1)
    c = a.Checkpointer()
    try:
        staged = c._place(entries)
        c._ensure_segment(staged.size)
        told: list[tuple[int, bool]] = []

        def tell(end, done=False):
            for e, row in zip(entries, staged.entries):  # what is told is there already
                off, n = row.offset, row.nbytes
                if off + n <= end:
                    got = c._seg.tensor[off : off + n].view(e.local.dtype).view(e.local.shape)
                    assert torch.equal(got, e.local), e.name
            told.append((end, done))

        c._copy(entries, staged, tell)
        ends = [t for t, _ in told]
        assert ends == sorted(ends) and len(ends) >= (4 * (100_000 + 70_000 + 150_000)) // (64 << 10) - 4
        rows = {e.name: row for e, row in zip(entries, staged.entries)}
        inside = [t for t in ends if rows["row"].offset < t < rows["row"].offset + rows["row"].nbytes]
        assert len(inside) >= 400_000 // (64 << 10) - 1  # the 1 x N tensor is told in blocks
        for e, row in zip(entries, staged.entries):
            got = c._seg.tensor[row.offset : row.offset + row.nbytes].view(e.local.dtype).view(e.local.shape)
            assert torch.equal(got, e.local), e.name
    finally:
        c.close()
