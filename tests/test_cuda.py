"""CUDA paths (skipped without a GPU; run on a GPU machine): device tensors saved and loaded
(device-to-host per range, host-to-device on load), async staging into pinned shared memory,
an NCCL group (pieces travel on its gloo side group), compression of device state, and the
trainer on ``cuda``."""

import os

import pytest
import torch

import unickpt
from tests import dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    master = {"w": torch.randn(257, 96, generator=g), "b": torch.randn(96, generator=g)}
    return {
        "model": {k: v.to(torch.bfloat16).to(device) for k, v in master.items()},
        "master": {k: v.to(device) for k, v in master.items()},
        "optimizer": {"exp_avg": {k: (torch.randn(v.shape, generator=g) * 1e-3).to(device) for k, v in master.items()},
                      "exp_avg_sq": {k: (torch.rand(v.shape, generator=g) * 1e-6).to(device) for k, v in master.items()}},
        "trainer": {"step": 3},
    }


def _zeros(sd, device):
    return {r: ({k: ({n: torch.zeros_like(t, device=device) for n, t in v.items()} if isinstance(v, dict)
                     else torch.zeros_like(v, device=device)) for k, v in d.items()} if isinstance(d, dict) and r != "trainer" else {"step": 0})
            for r, d in sd.items()}


def _same(a, b):
    for r in ("model", "master"):
        for k in a[r]:
            assert torch.equal(a[r][k].cpu(), b[r][k].cpu()), (r, k)
    for m in ("exp_avg", "exp_avg_sq"):
        for k in a["optimizer"][m]:
            assert torch.equal(a["optimizer"][m][k].cpu(), b["optimizer"][m][k].cpu()), (m, k)


def test_device_state_round_trip_sync_async_and_compressed(tmp_path):
    sd = _state("cuda")
    unickpt.save(sd, tmp_path / "sync")
    h = unickpt.save(sd, tmp_path / "async", async_save=True)
    for t in sd["master"].values():  # mutate on the device right after the call: staged already
        t.add_(1.0)
    h.wait()
    sd = _state("cuda")  # the values both saves saw
    for name in ("sync", "async"):
        got = _zeros(sd, "cuda")
        unickpt.load(got, tmp_path / name, verify="full")
        _same(got, sd)
        assert got["trainer"]["step"] == 3
    cpu = _zeros(sd, "cpu")
    unickpt.load(cpu, tmp_path / "async")
    _same(cpu, sd)
    # compressed, from device tensors: same bytes as from host copies of them
    unickpt.save(sd, tmp_path / "q-dev", quant="O1", master="residual", zstd=3)
    host = {r: ({k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v.cpu()) for k, v in d.items()}
                if r != "trainer" else d) for r, d in sd.items()}
    unickpt.save(host, tmp_path / "q-host", quant="O1", master="residual", zstd=3)
    a, b = _zeros(sd, "cuda"), _zeros(sd, "cpu")
    unickpt.load(a, tmp_path / "q-dev", verify="full")
    unickpt.load(b, tmp_path / "q-host", verify="full")
    _same(a, b)
    assert all(torch.equal(a["master"][k].cpu(), sd["master"][k].cpu()) for k in sd["master"])


def _nccl_job(rank, world, root):
    import torch.distributed as dist_

    assert dist_.get_backend() == "nccl"
    sd = _state("cuda")
    unickpt.save(sd, os.path.join(root, "nccl"), step=1)
    h = unickpt.save(sd, os.path.join(root, "nccl-async"), step=2, async_save=True, quant="O2")
    h.wait()
    got = _zeros(sd, "cuda")
    unickpt.load(got, os.path.join(root, "nccl"))
    _same(got, sd)
    got2 = _zeros(sd, "cuda")
    unickpt.load(got2, os.path.join(root, "nccl-async"))
    return True


def test_nccl_group_uses_a_gloo_side_group(tmp_path):
    assert dist.run(_nccl_job, 1, str(tmp_path), backend="nccl") == [True]


def _gloo_two_ranks_on_one_gpu(rank, world, root):
    """Two ranks, device pieces on the same GPU (gloo moves host copies): ZeRO-style halves
    saved, then loaded as the other halves."""
    full = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
    lay = unickpt.partition_flat([(100, 100)], world, rank)[0][1]
    local = full.reshape(-1)[lay.flat[0] : lay.flat[1]].clone().cuda()
    unickpt.save({"model": {"w": unickpt.ShardedTensor(local, lay)}}, os.path.join(root, "g"))
    other = unickpt.partition_flat([(100, 100)], world, 1 - rank)[0][1]
    target = torch.zeros(other.numel, device="cuda")
    unickpt.load({"model": {"w": unickpt.ShardedTensor(target, other)}}, os.path.join(root, "g"))
    # a plain tensor held whole on the host by rank 0 and on the GPU by rank 1: the copies are
    # compared with one fingerprint (equal: saved; different: refused on both ranks)
    b = full[0].clone() if rank == 0 else full[0].cuda()
    unickpt.save({"model": {"b": b}}, os.path.join(root, "mixed"))
    try:
        unickpt.save({"model": {"b": b + rank}}, os.path.join(root, "mixed2"))
        refused = False
    except unickpt.errors.StateDictError:
        refused = True
    return bool(torch.equal(target.cpu(), full.reshape(-1)[other.flat[0] : other.flat[1]])) and refused


def test_two_ranks_with_device_pieces(tmp_path):
    assert dist.run(_gloo_two_ranks_on_one_gpu, 2, str(tmp_path)) == [True, True]


def _cuda_trainer(rank, world, ckpt, steps, resume):
    from unickpt.train import LlamaConfig, OptimConfig, TextData, Trainer, UnifiedCheckpoint

    t = Trainer(
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
        TextData(seq_len=32, max_bytes=1 << 20, seed=1),
        optim=OptimConfig(lr=1e-2, warmup=2, total_steps=6),
        checkpoint=UnifiedCheckpoint(dir=ckpt, every=3, async_save=True, quant="O1", master="residual") if ckpt else None,
        global_batch=8, micro_batch=4, dtype="bf16", device="cuda:0", resume="auto" if resume else None,
    )
    return [r["loss"] for r in t.fit(steps)]


def test_trainer_on_cuda_with_async_quantized_checkpoints(tmp_path):
    d = str(tmp_path / "ck")
    first = dist.run(_cuda_trainer, 1, d, 3, False, backend="nccl")[0]
    rest = dist.run(_cuda_trainer, 1, d, 6, True, backend="nccl")[0]
    full = dist.run(_cuda_trainer, 1, None, 6, False, backend="nccl")[0]
    assert first == full[:3]
    for a, b in zip(rest, full[3:]):
        assert abs(a - b) <= 0.05 * abs(b), (rest, full)


@pytest.mark.parametrize("on", ["default", "side"])
def test_a_background_copy_waits_for_the_work_before_the_save_and_not_for_the_kernels_after_it(tmp_path, on):
    """Staging copies run on the checkpointer's own stream after an event on the caller's
    stream: the state produced by kernels still queued at the call is what is saved, and
    ``wait_staged()`` returns while the kernels the caller queued after the call still run
    (on the legacy default stream they would delay each other). The segment is pinned.
    The first background save of a process is not judged: on an H200 it waited for the
    kernels queued after the call (some one-time CUDA set-up, cause not established), every
    later one did not."""
    stream = torch.cuda.current_stream() if on == "default" else torch.cuda.Stream()
    ts = {f"t{i}": torch.zeros(10_000_000, device="cuda") for i in range(3)}  # 120 MB: several stage chunks
    unickpt.save({"model": ts}, tmp_path / "first", async_save=True, background_staging=True).wait(timeout=120)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # the step that produces the state is still running at the call
        for i, t in enumerate(ts.values()):
            t.fill_(i + 1.0)
        h = unickpt.save({"model": ts}, tmp_path / "c", async_save=True, background_staging=True)
        torch.cuda._sleep(4_000_000_000)  # the next step's kernels, queued after the call (~2 s)
        after = torch.cuda.Event()
        after.record(stream)
    h.wait_staged(timeout=60)
    assert not after.query(), "the copy waited for the kernels queued after the save"
    seg = h._owner._seg
    assert seg.pinned and seg.tensor.is_pinned()
    with torch.cuda.stream(stream):
        for t in ts.values():
            t.fill_(-1.0)  # the update after wait_staged: not in the checkpoint
    h.wait(timeout=120)
    got = {k: torch.empty(10_000_000) for k in ts}
    unickpt.load({"model": got}, tmp_path / "c", verify="full")
    for i, k in enumerate(ts):
        assert torch.equal(got[k], torch.full((10_000_000,), i + 1.0)), k


def _fsdp_cuda(rank, world, root, mode):
    from tests.hf_models import fsdp, llama
    from tests.test_semantics import _llama_state, _llama_steps

    model = fsdp(llama(seed=0 if mode == "save" else 5).cuda(), world, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if mode == "save" else 0.5, weight_decay=0.1)
    if mode == "save":
        _llama_steps(model, opt, 2, device="cuda")
        state, groups = _llama_state(model, opt)
        h = unickpt.save({"model": model, "optim": opt}, os.path.join(root, "llama"), step=2, async_save=True,
                         background_staging=True)
        h.wait_staged(timeout=60)
        losses = _llama_steps(model, opt, 2, seed=11, device="cuda")  # changes every parameter and moment
        assert h.wait(timeout=120).step == 2
    else:
        res = unickpt.load({"model": model, "optim": opt}, os.path.join(root, "llama"))
        assert res.missing == [] and res.unexpected == []
        state, groups = _llama_state(model, opt)
        losses = _llama_steps(model, opt, 2, seed=11, device="cuda")
    return {k: v.cpu().tolist() for k, v in state.items()}, groups, losses


def test_fsdp2_llama_on_the_gpu_saved_in_the_background_resumes_on_gpu_and_cpu(tmp_path):
    """An FSDP2 Llama (transformers config) on the GPU, NCCL group, saved with background
    staging while the next steps run; resumed bit-exact on the GPU and on a CPU process."""
    from tests.test_semantics import _fsdp_resume

    root = str(tmp_path)
    want, groups, losses = dist.run(_fsdp_cuda, 1, root, "save", backend="nccl", timeout=300)[0]
    got, g2, l2 = dist.run(_fsdp_cuda, 1, root, "load", backend="nccl", timeout=300)[0]
    assert [k for k in want if got[k] != want[k]] == [] and set(got) == set(want) and g2 == groups
    assert l2 == losses
    cpu, g3, _, unexpected, missing = _fsdp_resume(0, 1, root)
    assert unexpected == [] and missing == [] and g3 == groups
    assert [k for k in want if cpu[k] != want[k]] == [] and set(cpu) == set(want)


def test_a_load_into_device_targets_comes_after_the_callers_queued_work_and_is_complete_on_return(tmp_path):
    """Device targets are filled by copies from host temporaries on the caller's thread and
    current stream, each waited for: a fill of the target still queued at the call (here
    behind a ~0.1 s sleep on a side stream) cannot overwrite the loaded bytes, and every
    byte is in place when ``load`` returns. Whole tensors (long runs) and a column block
    (short runs)."""
    g = torch.Generator().manual_seed(7)
    full = {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(3000, generator=g)}
    unickpt.save({"model": full}, tmp_path / "c")
    stream = torch.cuda.Stream()
    whole = {k: torch.empty_like(v, device="cuda") for k, v in full.items()}
    col = torch.empty(1024, 200, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        for t in (*whole.values(), col):
            t.fill_(-7.0)  # queued before the load: must not land after it
        unickpt.load({"model": whole}, tmp_path / "c", verify="full")
        unickpt.load({"model": {"w": unickpt.shard(col, (1024, 512), offsets=(0, 300))}}, tmp_path / "c", strict=False)
        got = [whole["w"].cpu(), whole["b"].cpu(), col.cpu()]  # on the caller's stream, right after
    assert torch.equal(got[0], full["w"]) and torch.equal(got[1], full["b"])
    assert torch.equal(got[2], full["w"][:, 300:500])
