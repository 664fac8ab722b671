"""The validation trainer is right before any checkpoint is blamed, and resumes through unickpt.

* ZeRO stage 0-3 and TP runs match single-process training (fp32) within 1e-4 relative
  (only the reduction order differs between strategies).
* Stop and resume under the same strategy: bit-identical losses.
* Stop, then resume under another strategy: within 1e-4 relative.
"""

import os

import pytest

from tests import dist

STEPS = 6
TOL = 1e-4


def _train(rank, world, stage, tp, steps, ckpt_dir=None, save_at=None, resume=False):
    import torch

    from unickpt.train import LlamaConfig, OptimConfig, ParallelConfig, TextData, Trainer, UnifiedCheckpoint

    torch.use_deterministic_algorithms(True)
    data = TextData(seq_len=32, max_bytes=1 << 20, seed=1)
    ck = UnifiedCheckpoint(dir=ckpt_dir, every=save_at or 0) if ckpt_dir else None
    t = Trainer(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        data,
        parallel=ParallelConfig(zero_stage=stage, tp=tp),
        optim=OptimConfig(lr=1e-2, warmup=2, total_steps=STEPS),  # one schedule for first and resumed runs
        checkpoint=ck,
        global_batch=8,
        micro_batch=2,
        resume="auto" if resume else None,
    )
    out = t.fit(steps)
    return [r["loss"] for r in out], t.history[-1]["eval_loss"]


def _single(steps, **kw):
    return _train(0, 1, 0, 1, steps, **kw)


@pytest.fixture(scope="module")
def reference():
    return _single(STEPS)


def _close(a, b, tol=TOL):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * abs(y), (a, b)


@pytest.mark.parametrize("world,stage,tp", [(2, 0, 1), (2, 1, 1), (2, 2, 1), (2, 3, 1), (2, 0, 2), (4, 1, 2), (4, 3, 2)])
def test_parallel_training_matches_single_process(reference, world, stage, tp):
    out = dist.run(_train, world, stage, tp, STEPS)
    losses, ev = out[0]
    _close(losses, reference[0])
    assert abs(ev - reference[1]) <= TOL * reference[1]
    for o in out[1:]:
        assert o[0] == losses  # every rank reports the same global loss


def test_same_strategy_resume_is_bit_identical(tmp_path, reference):
    d = str(tmp_path / "ck")
    first = dist.run(_train, 2, 2, 1, 3, d, 3)[0][0]
    rest = dist.run(_train, 2, 2, 1, STEPS, d, None, True)[0][0]
    full = dist.run(_train, 2, 2, 1, STEPS)[0][0]
    assert first + rest == full


@pytest.mark.parametrize("src,dst", [((4, 2, 1), (2, 0, 2)), ((2, 3, 1), (1, 0, 1)), ((4, 1, 2), (2, 3, 1))])
def test_cross_strategy_resume(tmp_path, reference, src, dst):
    d = str(tmp_path / "ck")
    (ws, ss, ts), (wd, sd_, td) = src, dst
    first = dist.run(_train, ws, ss, ts, 3, d, 3)[0][0]
    rest = dist.run(_train, wd, sd_, td, STEPS, d, None, True)[0][0]
    _close(first + rest, reference[0])
