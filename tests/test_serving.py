"""Live weight updates (issue #41 item 2): a trainer publishes its model every K steps through
UnifiedCheckpoint; inference ranks of a job of their own, in the fused TP layout, update a
resident model in place; a version being read is never retired, a torn one never seen,
whoever is killed when."""

import os
import signal
import threading
import time

import pytest
import torch

import unickpt
from tests import dist
from tests.test_mapping import HF, _fused_expected
from unickpt.publish import LEASES, retire_unleased

STEPS = 4


def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**HF)
    return AutoModelForCausalLM.from_config(config), config


def _train_step(model, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * (step + 1) * (i + 1))


def test_a_resident_model_updates_in_place_to_each_published_version(tmp_path):
    """One process each side: every update returns the newest version, the serving tensors
    (fused, bf16) equal the trainer's weights of that step cast to bf16, no tensor is
    reallocated; with nothing newer, update returns None by its timeout."""
    model, config = _llama()
    ckpt = unickpt.UnifiedCheckpoint(tmp_path / "ckpt", publish_dir=tmp_path / "pub", publish_every=2,
                                     publish_dtype=torch.bfloat16, publish_keep=2)
    want = {k: v.to(torch.bfloat16) for k, v in _fused_expected(model.state_dict(), config, 0, 1).items()}
    serving = {k: torch.zeros_like(v) for k, v in want.items()}
    ptrs = {k: v.data_ptr() for k, v in serving.items()}
    sub = unickpt.WeightSubscriber(tmp_path / "pub", mapping=unickpt.Mapping.fused(config))
    assert sub.update(serving, timeout=0.1) is None and sub.version is None
    for step in range(1, STEPS + 1):
        _train_step(model, step)
        ckpt.step(step, {"model": model})
        if step % 2 == 0:
            assert sub.update(serving, timeout=5) == step
            want = {k: v.to(torch.bfloat16) for k, v in _fused_expected(model.state_dict(), config, 0, 1).items()}
            assert all(torch.equal(serving[k], v) for k, v in want.items())
    assert {k: v.data_ptr() for k, v in serving.items()} == ptrs
    assert sub.update(serving, timeout=0.2) is None and sub.version == STEPS
    ckpt.close(final_save=False)
    assert sorted(n for n in os.listdir(tmp_path / "pub") if n.startswith("step-")) == ["step-00000002",
                                                                                       "step-00000004"]


def test_a_leased_version_is_kept_and_a_dead_readers_lease_is_not(tmp_path):
    from unickpt.io.storage import storage_for
    from unickpt.liveness import me
    from unickpt.publish import publish

    pub = str(tmp_path / "pub")
    m = torch.nn.Linear(4, 4)
    publish(m, pub, 1)
    os.makedirs(os.path.join(pub, LEASES))
    live = os.path.join(pub, LEASES, "step-00000001.live")
    with open(live, "w") as f:
        f.write(__import__("json").dumps(me()))
    dead_rec = dict(me(), pid=2**22 + 17)  # a pid that runs nowhere here
    publish(m, pub, 2, keep=1)
    publish(m, pub, 3, keep=1)
    names = sorted(n for n in os.listdir(pub) if n.startswith("step-"))
    assert names == ["step-00000001", "step-00000003"]  # 1 is read, 2 went
    os.remove(live)
    with open(os.path.join(pub, LEASES, "step-00000003.dead"), "w") as f:
        f.write(__import__("json").dumps(dead_rec))
    storage, root = storage_for(pub)
    publish(m, pub, 4, keep=1)
    assert sorted(n for n in os.listdir(pub) if n.startswith("step-")) == ["step-00000004"]
    assert os.listdir(os.path.join(pub, LEASES)) == []  # the dead reader's lease is cleared
    assert retire_unleased(storage, root, 1) == []


def _trainer(rank, world, pub, steps):
    model, _ = _llama()
    ckpt = unickpt.UnifiedCheckpoint(os.path.join(pub, "..", "ckpt"), publish_dir=pub, publish_every=1,
                                     publish_dtype=torch.bfloat16, publish_keep=2)
    for step in range(1, steps + 1):
        _train_step(model, step)
        ckpt.step(step, {"model": model})
        time.sleep(0.2)
    ckpt.close(final_save=False)
    return True


def _inference(rank, world, pub, steps, die_in_load):
    """TP rank ``rank`` of ``world``: update until the last version; each version's shard
    checked against the trainer's weights of that step (recomputed here)."""
    from unickpt.loading import session

    model, config = _llama()
    sub = unickpt.WeightSubscriber(pub, mapping=unickpt.Mapping.fused(config, tp_rank=rank, tp_size=world),
                                   timeout_s=15)
    serving = {k: torch.zeros_like(v, dtype=torch.bfloat16)
               for k, v in _fused_expected(model.state_dict(), config, rank, world).items()}
    if die_in_load and rank == 1:
        run = session.ReadSession.run

        def dying(self, entries):
            os.kill(os.getpid(), signal.SIGKILL)
            return run(self, entries)

        session.ReadSession.run = dying
    seen = []
    try:
        while not seen or seen[-1] < steps:
            v = sub.update(serving, timeout=60)
            assert v is not None
            ref, _ = _llama()
            for s in range(1, v + 1):
                _train_step(ref, s)
            want = _fused_expected({k: t.to(torch.bfloat16) for k, t in ref.state_dict().items()}, config, rank, world)
            assert all(torch.equal(serving[k], t) for k, t in want.items()), v
            seen.append(v)
    except unickpt.errors.UnickptError as e:
        return ("error", type(e).__name__, sub.version)
    return ("ok", seen)


def test_a_trainer_job_and_an_inference_job_of_other_sizes_on_loopback(tmp_path):
    """Two jobs of their own (a 2-rank trainer publishing every step, a 2-rank TP inference
    job in the fused layout): every version an inference rank holds is a whole version, equal
    to the trainer's weights of that step; the last one arrives."""
    pub = str(tmp_path / "pub")
    os.makedirs(pub)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(trainer=dist.run(_trainer, 2, pub, STEPS)))
    t.start()
    try:
        res = dist.run(_inference, 2, pub, STEPS, False)
    finally:
        t.join(120)
    assert out["trainer"] == [True, True]
    for kind, seen in res:
        assert kind == "ok" and seen[-1] == STEPS and seen == sorted(seen)


def test_an_inference_rank_killed_mid_update_fails_its_peer_in_bounded_time(tmp_path):
    """kill -9 of an inference rank inside a load: its peer raises a typed error (bounded by
    the subscriber's timeout) and knows its model holds no whole version (version None); the
    dead rank's lease holds nothing back."""
    from unickpt.publish import publish

    pub = str(tmp_path / "pub")
    model, _ = _llama()
    publish(model.state_dict(), pub, 1, dtype=torch.bfloat16)
    res = dist.run(_inference, 2, pub, 1, True, may_die={1})
    assert res[1] is None
    assert res[0][0] == "error" and res[0][2] is None, res
    publish(model.state_dict(), pub, 2, dtype=torch.bfloat16, keep=1)
    publish(model.state_dict(), pub, 3, dtype=torch.bfloat16, keep=1)
    assert sorted(n for n in os.listdir(pub) if n.startswith("step-")) == ["step-00000003"]


def _dying_trainer(rank, world, pub):
    from unickpt.publish import publish

    model, _ = _llama()
    publish(model.state_dict(), pub, 1, dtype=torch.bfloat16)
    from unickpt.saving import writer

    orig = writer.RankWriter.__init__

    def dying(self, *a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
        orig(self, *a, **k)

    writer.RankWriter.__init__ = dying
    _train_step(model, 1)
    publish(model.state_dict(), pub, 2, dtype=torch.bfloat16)


def test_a_trainer_killed_mid_publish_leaves_no_version_a_reader_can_see(tmp_path):
    pub = str(tmp_path / "pub")
    dist.run(_dying_trainer, 1, pub, may_die={0})
    model, config = _llama()
    sub = unickpt.WeightSubscriber(pub)
    assert sub.newest() == 1
    target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    assert sub.update(target, timeout=1) == 1
    assert all(torch.equal(target[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items())
    assert any(n.startswith(".step-00000002.tmp-") for n in os.listdir(pub))  # what the killed publish left
    from unickpt.publish import publish

    publish(model.state_dict(), pub, 3, dtype=torch.bfloat16)
    assert sorted(n for n in os.listdir(pub) if n != LEASES) == ["step-00000001", "step-00000003"]  # swept


def test_a_run_that_starts_over_and_the_mistakes_a_new_user_made(tmp_path):
    """From a newcomer's session: a run started over on a publish_dir holding newer versions
    skips its publishes, typed and said (they would be retired at once, unseen); update
    refuses {'model': ...} with what to pass instead; cast=True converts like a load."""
    from unickpt.publish import publish

    pub = str(tmp_path / "pub")
    model, config = _llama()
    publish(model.state_dict(), pub, 10)  # (fp32: an earlier run, further on)
    with pytest.raises(unickpt.errors.NewerVersionError, match="older than the newest published version 10"):
        publish(model.state_dict(), pub, 3)
    events = []
    ck = unickpt.UnifiedCheckpoint(tmp_path / "ck", publish_dir=pub, on_event=events.append)
    ck.step(1, {"model": model})
    ck.close(final_save=False)
    assert {"event": "publish_skipped", "step": 1, "reason": "older"} in events
    assert sorted(n for n in os.listdir(pub) if n.startswith("step-")) == ["step-00000010"]
    sub = unickpt.WeightSubscriber(pub, mapping=unickpt.Mapping.fused(config))
    serving = {k: torch.zeros_like(v, dtype=torch.bfloat16)
               for k, v in _fused_expected(model.state_dict(), config, 0, 1).items()}
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="not {'model': ...}"):
        sub.update({"model": serving}, timeout=1)
    with pytest.raises(unickpt.errors.DtypeMismatchError):  # stored fp32, targets bf16
        sub.update(serving, timeout=1)
    sub = unickpt.WeightSubscriber(pub, mapping=unickpt.Mapping.fused(config), cast=True)
    assert sub.update(serving, timeout=1) == 10
    want = _fused_expected(model.state_dict(), config, 0, 1)
    assert all(torch.equal(serving[k], v.to(torch.bfloat16)) for k, v in want.items())


def test_publishing_through_an_object_store_with_leases(s3, tmp_path, monkeypatch):
    """Versions on S3 (the loopback server): a subscriber updates from them; a version a
    reader leases is uncommitted when retired (no new reader starts on it) but its files stay
    until the lease is gone, then a later publish sweeps them; a lease taken on a version
    whose manifest is gone is dropped (the reader looks again)."""
    from unickpt.io import commit
    from unickpt.io.storage import storage_for

    pub = s3.bucket("pub") + "/run"
    model, config = _llama()
    ckpt = unickpt.UnifiedCheckpoint(tmp_path / "ckpt", publish_dir=pub, publish_every=1, publish_dtype=torch.bfloat16,
                                     publish_keep=1)
    want = {k: v.to(torch.bfloat16) for k, v in _fused_expected(model.state_dict(), config, 0, 1).items()}
    serving = {k: torch.zeros_like(v) for k, v in want.items()}
    sub = unickpt.WeightSubscriber(pub, mapping=unickpt.Mapping.fused(config))
    ckpt.step(1, {"model": model})
    assert sub.update(serving, timeout=10) == 1
    assert all(torch.equal(serving[k], v) for k, v in want.items())
    reader = unickpt.WeightSubscriber(pub)
    lease = reader._lease(1)  # a reader in the middle of reading version 1
    assert lease is not None
    _train_step(model, 2)
    ckpt.step(2, {"model": model})  # keep=1: version 1 is retired, but leased
    storage, root = storage_for(pub)
    step1 = storage.join(root, "step-00000001")
    assert unickpt.WeightSubscriber(pub).newest() == 2
    assert any(m.key.endswith(".safetensors") for m in storage.list_objects(step1))  # its bytes are still there
    assert reader._lease(1) is None  # uncommitted: a new lease on it is dropped
    assert sub.update(serving, timeout=10) == 2
    want = {k: v.to(torch.bfloat16) for k, v in _fused_expected(model.state_dict(), config, 0, 1).items()}
    assert all(torch.equal(serving[k], v) for k, v in want.items())
    reader._release(lease)
    monkeypatch.setattr(commit, "NO_OWNER_GRACE", 0.0)  # (files written a moment ago count as orphans now)
    _train_step(model, 3)
    ckpt.step(3, {"model": model})
    assert storage.list_objects(step1) == []  # swept once nobody reads it
    assert sorted(s for s, _ in __import__("unickpt.io.catalog", fromlist=["x"]).committed_steps(storage, root)) == [3]
    ckpt.close(final_save=False)


def test_a_long_update_keeps_its_lease_fresh(tmp_path, monkeypatch):
    """A load longer than a quarter of the lease's life rewrites the lease while it runs (a
    reader on another host is judged by the lease's age)."""
    import unickpt.loading as loading
    import unickpt.publish as publish_mod
    from unickpt.publish import publish

    pub = str(tmp_path / "pub")
    model, _ = _llama()
    publish(model.state_dict(), pub, 1, dtype=torch.bfloat16)
    monkeypatch.setattr(publish_mod, "LEASE_STALE_S", 0.4)  # (rewritten every 0.1 s)
    seen = []
    real = loading.load

    def slow(*a, **k):
        d = os.path.join(pub, LEASES)
        for _ in range(8):
            time.sleep(0.1)
            seen.extend(os.path.getmtime(os.path.join(d, n)) for n in os.listdir(d))
        return real(*a, **k)

    monkeypatch.setattr(loading, "load", slow)
    target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    assert unickpt.WeightSubscriber(pub).update(target, timeout=5) == 1
    assert len(set(seen)) >= 3  # the lease was written again and again during the load
    assert os.listdir(os.path.join(pub, LEASES)) == []  # and released after it


def test_findings_of_the_serving_attack_are_refused_typed(tmp_path):
    """From an attack session on mappings and publishing: each now a typed refusal (or, for
    a resumed run, a skipped publish), nothing silently wrong."""
    import json
    import socket

    from transformers import LlamaConfig

    from unickpt.errors import InvalidArgumentError, MappingError, NotSupportedError

    model, config = _llama()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    unickpt.save({"model": sd}, str(tmp_path / "ck" / "step-00000001"))
    path = str(tmp_path / "ck")
    # a row- or vocab-parallel target of another size than the rank's share: refused, untouched
    for name, shape in (("model.layers.0.mlp.down_proj.weight", (32, 20)), ("lm_head.weight", (40, 32))):
        t = torch.zeros(shape)
        with pytest.raises(MappingError, match="share"):
            unickpt.load({"model": {name: t}}, path, options=unickpt.LoadOptions(
                mapping=unickpt.Mapping.fused(config, tp_rank=1, tp_size=2)))
        assert not t.any()
    # a config whose heads contradict the checkpoint (8 KV heads of 4 rows, where 2 of 16 are stored)
    wrong = LlamaConfig(**{**HF, "num_attention_heads": 8, "num_key_value_heads": 8})
    qkv = torch.zeros(32, 32)
    with pytest.raises(MappingError, match="heads"):
        unickpt.load({"model": {"model.layers.0.self_attn.qkv_proj.weight": qkv}}, path,
                     options=unickpt.LoadOptions(mapping=unickpt.Mapping.fused(wrong, tp_rank=1, tp_size=4)))
    for kw in (dict(num_heads=4, num_kv_heads=8), dict(num_heads=6, num_kv_heads=4),
               dict(num_heads=4, num_kv_heads=2, tp_size=8, tp_rank=0), dict(num_heads=4, num_kv_heads=2, tp_size=True)):
        with pytest.raises(MappingError):
            unickpt.Mapping.fused(**kw)
    # user rules
    for bad in (lambda: unickpt.Mapping.rename([("x(", "a")]), lambda: unickpt.Mapping.rename([(1, 2)]),
                lambda: unickpt.Mapping.rename([("a", "b", "c")]), lambda: unickpt.Mapping.stacked_experts("x", "y.w"),
                lambda: unickpt.Mapping.stacked_experts("x", "y.{e}", dim=-1)):
        with pytest.raises(MappingError):
            bad()
    with pytest.raises(MappingError):
        unickpt.load({"model": {"a": torch.zeros(4, 4)}}, path, options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.rename([(r"a", r"\5")])))
    with pytest.raises(TypeError):
        unickpt.Mapping.rename({}) + "x"
    # dir and publish_dir apart; a process-local store refused when built (other jobs cannot see it)
    with pytest.raises(InvalidArgumentError, match="apart"):
        unickpt.UnifiedCheckpoint(tmp_path / "same", publish_dir=tmp_path / "same")
    with pytest.raises(InvalidArgumentError, match="apart"):
        unickpt.UnifiedCheckpoint(tmp_path / "d", publish_dir=tmp_path / "d" / "pub")
    with pytest.raises(NotSupportedError, match="one process"):
        unickpt.UnifiedCheckpoint(tmp_path / "d", publish_dir="memory://b/p")
    # a resumed run reaching a step an earlier run published: skipped, not a crash
    events = []
    ck = unickpt.UnifiedCheckpoint(tmp_path / "rs", every=4, publish_dir=tmp_path / "rp", publish_every=2)
    for s in range(1, 7):
        ck.step(s, {"model": model})
    ck.close(final_save=False)
    ck = unickpt.UnifiedCheckpoint(tmp_path / "rs", every=4, publish_dir=tmp_path / "rp", publish_every=2,
                                   on_event=events.append)
    assert ck.resume({"model": model}) == 4
    ck.step(5, {"model": model})
    ck.step(6, {"model": model})
    ck.close(final_save=False)
    assert {"event": "publish_skipped", "step": 6, "reason": "exists"} in events
    # a planted lease naming no process: cleared, not a crash
    pub = tmp_path / "planted"
    os.makedirs(pub / LEASES)
    (pub / LEASES / "step-00000001.x").write_text(json.dumps({"host": socket.gethostname(), "pid": -1}))
    from unickpt.publish import publish

    publish(sd, str(pub), 1)
    publish(sd, str(pub), 2, keep=1)
    assert sorted(n for n in os.listdir(pub) if n.startswith("step-")) == ["step-00000002"]
    assert os.listdir(pub / LEASES) == []
    # unickpt.retain keeps a leased step too
    from unickpt.liveness import me

    (pub / LEASES / "step-00000002.y").write_text(json.dumps(me()))
    publish(sd, str(pub), 3, keep=5)
    assert unickpt.retain(str(pub), 1) == [] and (pub / "step-00000002").is_dir()
    with pytest.raises(InvalidArgumentError, match="model"):
        unickpt.WeightSubscriber(str(pub)).update([torch.zeros(2)], timeout=0)


def _publish_alone(rank, world, pub):
    from unickpt.publish import publish

    if rank == 0:  # one rank of a running job publishes alone (group="local"), as a trainer's rank 0 may
        publish({"w": torch.full((4,), 3.0)}, pub, 1, group="local")
        publish({"w": torch.full((4,), 4.0)}, pub, 2, group="local", keep=1)
    return True


def test_one_rank_of_a_job_publishes_alone(tmp_path):
    pub = str(tmp_path / "pub")
    assert dist.run(_publish_alone, 2, pub) == [True, True]
    t = {"w": torch.zeros(4)}
    assert unickpt.WeightSubscriber(pub).update(t, timeout=1) == 2 and bool((t["w"] == 4).all())


def test_a_lease_is_never_written_through_a_planted_link(tmp_path):
    from unickpt.publish import publish

    pub, elsewhere = tmp_path / "pub", tmp_path / "elsewhere"
    publish({"w": torch.ones(4)}, str(pub), 1)
    os.makedirs(elsewhere)
    os.symlink(elsewhere, pub / LEASES)
    with pytest.raises(unickpt.errors.FormatError, match="link"):
        unickpt.WeightSubscriber(str(pub)).update({"w": torch.zeros(4)}, timeout=1)
    assert os.listdir(elsewhere) == []


def _uneven_clocks(rank, world, pub):
    """The ranks give update different timeouts (as clocks that drift apart would): rank 0's
    verdict holds for all, so none is left alone in a collective."""
    model, config = _llama()
    sub = unickpt.WeightSubscriber(pub, timeout_s=30)
    target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    first = sub.update(target, timeout=5)                     # version 1 is there
    none = sub.update(target, timeout=0.3 if rank == 0 else 20)  # nothing newer: rank 0's clock runs out first
    then = sub.update(target, timeout=0 if rank == 0 else 20)    # the ranks are still in step
    return first, none, then


def test_ranks_whose_timeouts_differ_still_agree_when_update_gives_up(tmp_path):
    from unickpt.publish import publish

    pub = str(tmp_path / "pub")
    model, _ = _llama()
    publish(model.state_dict(), pub, 1, dtype=torch.bfloat16)
    assert dist.run(_uneven_clocks, 2, pub, timeout=120) == [(1, None, None), (1, None, None)]


def test_another_hosts_lease_holds_its_version_for_its_life(tmp_path):
    """A lease written by a reader on another host (a shared file system) keeps its version
    while it is younger than LEASE_STALE_S, and not after (its reader may be gone)."""
    import json

    from unickpt.publish import LEASE_STALE_S, publish

    pub = str(tmp_path / "pub")
    publish({"w": torch.ones(4)}, pub, 1, keep=1)
    os.makedirs(os.path.join(pub, LEASES))
    lease = os.path.join(pub, LEASES, "step-00000001.abcdef")
    with open(lease, "w") as f:
        f.write(json.dumps({"host": "node-b-elsewhere", "pid": 4242, "started": 1.0}))
    publish({"w": torch.ones(4) * 2}, pub, 2, keep=1)
    assert sorted(n for n in os.listdir(pub) if n.startswith("step-")) == ["step-00000001", "step-00000002"]
    old = time.time() - LEASE_STALE_S - 5
    os.utime(lease, (old, old))
    publish({"w": torch.ones(4) * 3}, pub, 3, keep=1)
    assert sorted(n for n in os.listdir(pub) if n.startswith("step-")) == ["step-00000003"]
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="timeout"):
        unickpt.WeightSubscriber(pub).update({"w": torch.zeros(4)}, timeout=True)
