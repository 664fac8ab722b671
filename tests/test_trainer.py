"""The validation trainer is right before any checkpoint is blamed, and resumes through unickpt.

* ZeRO stage 0-3 and TP runs match single-process training (fp32) within 1e-4 relative
  (only the reduction order differs between strategies).
* Stop and resume under the same strategy: bit-identical losses.
* Stop, then resume under another strategy: within 1e-4 relative.
"""

import os
import re

import pytest

from tests import dist

STEPS = 6
TOL = 1e-4


def _train(rank, world, stage, tp, steps, ckpt_dir=None, save_at=None, resume=False, dtype="fp32", ckpt_kw=None):
    import torch

    from unickpt.train import LlamaConfig, OptimConfig, ParallelConfig, TextData, Trainer, UnifiedCheckpoint

    torch.use_deterministic_algorithms(True)
    data = TextData(seq_len=32, max_bytes=1 << 20, seed=1)
    ck = UnifiedCheckpoint(dir=ckpt_dir, every=save_at or 0, **(ckpt_kw or {})) if ckpt_dir else None
    t = Trainer(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        data,
        parallel=ParallelConfig(zero_stage=stage, tp=tp),
        optim=OptimConfig(lr=1e-2, warmup=2, total_steps=STEPS),  # one schedule for first and resumed runs
        checkpoint=ck,
        global_batch=8,
        micro_batch=2,
        resume="auto" if resume else None,
        dtype=dtype,
    )
    out = t.fit(steps)
    return [r["loss"] for r in out], [h["eval_loss"] for h in t.history if "eval_loss" in h][-1]


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


def test_same_strategy_resume_is_bit_identical(tmp_path, uninterrupted_losses):
    d = str(tmp_path / "ck")
    first = dist.run(_train, 2, 2, 1, 3, d, 3)[0][0]
    rest = dist.run(_train, 2, 2, 1, STEPS, d, None, True)[0][0]
    assert first + rest == uninterrupted_losses


def test_bf16_weights_fp32_master_resume_bit_identical(tmp_path):
    d = str(tmp_path / "ck")
    first = dist.run(_train, 2, 1, 1, 3, d, 3, False, "bf16")[0][0]
    rest = dist.run(_train, 2, 3, 1, STEPS, d, None, True, "bf16")[0][0]  # ZeRO-1 -> ZeRO-3, same dp
    full = dist.run(_train, 2, 1, 1, STEPS, None, None, False, "bf16")[0][0]
    assert first == full[:3]
    _close(rest, full[3:], 1e-2)  # bf16 compute: looser, reduction order differs between stages
    assert full[-1] < full[0]
    import unickpt

    _, man = unickpt.read_manifest(d)
    roles = {r: {t.dtype for (rr, _), t in man.tensors.items() if rr == r} for r, _ in man.tensors}
    assert roles["model"] == {"BF16"} and roles["master"] == {"F32"} and roles["optimizer"] == {"F32"}


# The representative matrix: {stage 0-3} x {tp 1, 2} x world {1, 2, 4}.
CONFIGS = {
    "w1": (1, 0, 1),
    "w2-z0": (2, 0, 1),
    "w2-z1": (2, 1, 1),
    "w2-z2": (2, 2, 1),
    "w2-z3": (2, 3, 1),
    "w2-tp2": (2, 0, 2),
    "w4-z2": (4, 2, 1),
    "w4-tp2-z1": (4, 1, 2),
    "w4-tp2-z3": (4, 3, 2),
}
STOP = 3


def _resume_all(rank, world, stage, tp, root, names):
    """Resume every source checkpoint under one destination strategy, in one job."""
    out = {}
    for name in names:
        out[name] = _train(rank, world, stage, tp, STEPS, os.path.join(root, name), None, True)[0]
    return out


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-matrix")
    for name, (w, st, tp) in CONFIGS.items():
        dist.run(_train, w, st, tp, STOP, str(root / name), STOP)
    return str(root)


@pytest.mark.parametrize("dst", sorted(CONFIGS))
def test_cross_strategy_resume_matrix(matrix_root, reference, dst):
    """Stop at step 3 under every strategy of the matrix, resume under ``dst``: the losses of
    the resumed steps stay within 1e-4 relative of the uninterrupted single-process run
    (measured: see docs/trainer.md)."""
    w, st, tp = CONFIGS[dst]
    resumed = dist.run(_resume_all, w, st, tp, matrix_root, sorted(CONFIGS))[0]
    worst = 0.0
    for src, losses in resumed.items():
        assert len(losses) == STEPS - STOP, src
        for x, y in zip(losses, reference[0][STOP:]):
            worst = max(worst, abs(x - y) / abs(y))
        _close(losses, reference[0][STOP:])
    print(f"max relative loss difference resuming under {dst}: {worst:.2e}")


def _mismatched_model(rank, world, root):
    import torch

    from unickpt.errors import ShapeMismatchError
    from unickpt.train import LlamaConfig, ParallelConfig, TextData, Trainer, UnifiedCheckpoint

    t = Trainer(
        LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        TextData(seq_len=32, max_bytes=1 << 20, seed=1),
        parallel=ParallelConfig(zero_stage=1),
        checkpoint=UnifiedCheckpoint(dir=root),
        global_batch=8,
        micro_batch=2,
    )
    before = [u.master.clone() for u in t.units.all()]
    try:
        t.load(root)
    except ShapeMismatchError as e:
        msg = str(e)
    else:
        msg = None
    untouched = all(torch.equal(a, u.master) for a, u in zip(before, t.units.all())) and t.step == 0
    return msg, untouched


def test_checkpoint_of_another_model_is_refused_naming_the_tensor(matrix_root):
    out = dist.run(_mismatched_model, 2, os.path.join(matrix_root, "w2-z1"))
    for msg, untouched in out:
        assert msg is not None
        assert re.search(r"tensor 'model\.[a-z_.0-9]+' \(role model\) is stored with shape \[\d+, 32\]", msg), msg
        assert "[256, 48]" in msg or "48]" in msg, msg
        assert untouched  # validated before any byte was read


def test_retention_keeps_the_newest_and_bad_compression_options_are_refused(tmp_path, caplog):
    import unickpt
    from unickpt.train import LlamaConfig, TextData, Trainer, UnifiedCheckpoint

    t = Trainer(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4),
        TextData(seq_len=16, max_bytes=1 << 18),
        checkpoint=UnifiedCheckpoint(dir=str(tmp_path), every=1, keep=2),
        global_batch=4,
        micro_batch=4,
        metrics_jsonl=str(tmp_path / "m" / "metrics.jsonl"),
    )
    t.fit(4)
    assert sorted(os.listdir(tmp_path)) == ["m", "step-00000003", "step-00000004"]
    assert unickpt.latest(tmp_path).endswith("step-00000004")
    assert os.path.exists(tmp_path / "step-00000004" / "config.json")
    import json

    recs = [json.loads(x) for x in open(tmp_path / "m" / "metrics.jsonl")]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert all({"loss", "lr", "tokens_per_s"} <= r.keys() for r in recs if "loss" in r)
    saves = [r for r in recs if r.get("event") == "save"]
    assert len(saves) == 4 and all({"blocking_s", "total_s", "bytes"} <= r.keys() for r in saves)
    assert [r for r in recs if r.get("event") == "eval"][-1]["step"] == 4
    # a damaged newest step: resume="auto" says why and resumes from the one before it
    d = tmp_path / "step-00000004"
    f = d / sorted(x for x in os.listdir(d) if x.startswith("model-"))[0]
    os.chmod(f, 0o644)
    b = bytearray(f.read_bytes())
    b[-9] ^= 0x10
    f.write_bytes(bytes(b))
    import shutil

    shutil.copytree(tmp_path / "step-00000003", tmp_path / "step-00000009")  # step 3 under a newer name
    with caplog.at_level("WARNING", logger="unickpt"):
        t2 = Trainer(
            LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4),
            TextData(seq_len=16, max_bytes=1 << 18),
            checkpoint=UnifiedCheckpoint(dir=str(tmp_path), every=0), global_batch=4, micro_batch=4, resume="auto")
    assert t2.step == 3
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "durable step 4" in said and "checksum" in said.lower() and "trying the next candidate" in said, said
    assert "named step 9, but its manifest says step 3" in said, said
    with pytest.raises(ValueError, match="quant must be"):
        UnifiedCheckpoint(dir=str(tmp_path), quant="O3")
    with pytest.raises(ValueError, match="master must be"):
        UnifiedCheckpoint(dir=str(tmp_path), master="half")


def test_compressed_checkpoints_resume_bf16_training(tmp_path):
    """bf16 weights, fp32 masters. Residual masters without quantization resume bit-identically
    (ZeRO-2 x 2 -> TP 2); O1 and O2 moments (async save: encoded in the writer process) resume
    close to the uninterrupted run but not identically (the moments really were quantized)."""
    import unickpt

    full = dist.run(_train, 2, 2, 1, STEPS, None, None, False, "bf16")[0][0]
    results = {}
    for name, kw in {"residual": dict(master="residual"),
                     "o1": dict(quant="O1", master="residual", async_save=True),
                     "o2": dict(quant="O2", master="drop")}.items():
        d = str(tmp_path / name)
        first = dist.run(_train, 2, 2, 1, STOP, d, STOP, False, "bf16", kw)[0][0]
        assert first == full[:STOP]
        _, man = unickpt.read_manifest(d)
        codecs = {(r, t.codec) for (r, _), t in man.tensors.items() if r in ("master", "optimizer")}
        want = {"residual": {("master", "residual16"), ("optimizer", "raw")},
                "o1": {("master", "residual16"), ("optimizer", "q8_sym"), ("optimizer", "q8_logw")},
                "o2": {("master", "from_model"), ("optimizer", "q4_logm"), ("optimizer", "q4_logw")}}[name]
        assert codecs == want, (name, codecs)
        results[name] = dist.run(_train, 2, 0, 2, STEPS, d, None, True, "bf16")[0][0]
    full_tp = dist.run(_resume_tp, 2, str(tmp_path / "residual"))[0]
    assert results["residual"] == full_tp  # bit-identical to resuming from the exact checkpoint
    for name in ("o1", "o2"):
        assert results[name] != full_tp, name
        _close(results[name], full[STOP:], 0.05)


def _resume_tp(rank, world, residual_dir):
    """Resume under TP 2 from an uncompressed copy of the same state (converted offline)."""
    from unickpt.offline import reshard_offline

    dst = residual_dir + "-plain"
    if rank == 0:
        os.makedirs(dst)
        reshard_offline(residual_dir, os.path.join(dst, f"step-{STOP:08d}"), master="full")
    import torch.distributed as dist_

    dist_.barrier()
    return _train(rank, world, 0, 2, STEPS, dst, None, True, "bf16")[0]
