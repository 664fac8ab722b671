"""Review of streamed (background) staging: failures that must stay typed, bounded and
paired across ranks."""

import os
import time

import pytest
import torch

import unickpt
from tests import dist
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
    t = time.monotonic()
    h = unickpt.save(sd, os.path.join(root, "step-00000002"), step=2, async_save=True, background_staging=True,
                     master=master, timeout_s=60)
    with pytest.raises(AsyncSaveError) as e:
        h.wait(timeout=120)
    # the writer's own answer (the handle's error; on rank 1 wait() raises the staging error first)
    h._owner._poll(h, timeout=120)
    if rank == 1:
        a.Checkpointer._copy = real
    err = str(h._error) if h._error is not None else str(e.value)
    return err, time.monotonic() - t


@pytest.mark.parametrize("master", ["residual", "drop"])
def test_background_copy_failure_with_a_master_policy_keeps_collectives_paired(tmp_path, master):
    """With master != "full" the writer waits for the whole copy before compressing the
    master weights: a rank whose copy fails must still take part in that phase's collective
    (compress.prepare's all-gather), else its agree() pairs with its peers' gather_json and
    the peers fail with a JSON decoding error that names no cause."""
    out = dist.run(_master_copy_fails, 2, str(tmp_path), master)
    for rank, (err, _) in enumerate(out):
        assert "injected copy failure" in err, (rank, err)
