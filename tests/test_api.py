"""The public API of #37: small and typed (save / save_async / load with option objects), the
load semantics DCP users expect (missing, unexpected, cast, bytes, per-rank stateful objects),
the deprecated forms still working with a warning that names the replacement, and
``UnifiedCheckpoint`` in a plain loop (four calls), elastic restarts included."""

import dataclasses
import inspect
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import unickpt
from tests import dist
from unickpt.errors import DtypeMismatchError, InvalidArgumentError, TensorMissingError, UnexpectedTensorError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model, opt, steps=2):
    for _ in range(steps):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()


# -- the surface -----------------------------------------------------------------------------


def test_the_public_names_are_listed_and_documented():
    names = set(unickpt.__all__)
    assert {"save", "save_async", "load", "SaveOptions", "LoadOptions", "UnifiedCheckpoint"} <= names
    assert names - {"__version__"} <= set(dir(unickpt))  # the lazily imported ones too
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        api = f.read()
    undocumented = sorted(n for n in names - {"__version__", "errors"} if f"`{n}" not in api and f"unickpt.{n}" not in api)
    assert not undocumented, f"public names missing from docs/api.md: {undocumented}"


def test_no_public_function_takes_more_than_eight_parameters():
    """Rare knobs live in SaveOptions / LoadOptions (the manager's constructor is its policy)."""
    wide = {}
    for n in unickpt.__all__:
        obj = getattr(unickpt, n)
        if inspect.isfunction(obj):
            ps = [p for p in inspect.signature(obj).parameters.values() if p.kind is not p.VAR_KEYWORD]
            if len(ps) > 8:
                wide[n] = len(ps)
    assert not wide, wide


def test_option_objects_are_frozen_keyword_only_and_checked():
    for cls in (unickpt.SaveOptions, unickpt.LoadOptions):
        with pytest.raises(TypeError):
            cls(1)  # keyword-only
        o = cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            o.timeout_s = 3
        for f in dataclasses.fields(cls):  # one docstring per field, shown in docs/api.md
            assert f.name in inspect.getsource(cls), f.name
    with pytest.raises(InvalidArgumentError, match="verify"):
        unickpt.LoadOptions(verify=True)
    with pytest.raises(InvalidArgumentError, match="bucket_bytes"):
        unickpt.SaveOptions(bucket_bytes=1.5)


def test_save_returns_a_result_and_save_async_a_handle(tmp_path):
    sd = {"model": {"w": torch.arange(6.0)}}
    res = unickpt.save(sd, tmp_path / "a", step=1)
    assert isinstance(res, unickpt.SaveResult) and res.step == 1
    h = unickpt.save_async(sd, tmp_path / "b", step=2, options=unickpt.SaveOptions(extra={"tag": "x"}))
    try:
        assert isinstance(h, unickpt.AsyncSave)
        r2 = h.wait()
        assert isinstance(r2, unickpt.SaveResult) and r2.step == 2
    finally:
        from unickpt import async_save

        async_save.shutdown()
    back = {"model": {"w": torch.zeros(6)}}
    assert unickpt.load(back, tmp_path / "b").extra == {"tag": "x"} and torch.equal(back["model"]["w"], torch.arange(6.0))
    with pytest.raises(TypeError, match="save_async"):
        unickpt.save(sd, tmp_path / "c", background_staging=True)


def test_deprecated_forms_warn_and_name_their_replacement(tmp_path):
    sd = {"model": {"w": torch.ones(4)}}
    with pytest.warns(DeprecationWarning, match=r"save\(quant=.*SaveOptions\(compression=unickpt.Compression\(quant="):
        unickpt.save({**sd, "optimizer": {"exp_avg_sq": {"w": torch.ones(4)}}}, tmp_path / "q", quant="O1")
    with pytest.warns(DeprecationWarning, match=r"save\(extra=.*SaveOptions\(extra="):
        unickpt.save(sd, tmp_path / "e", extra={"a": 1})
    with pytest.warns(DeprecationWarning, match="unickpt.save_async"):
        h = unickpt.save(sd, tmp_path / "s", async_save=True)
    try:
        assert isinstance(h, unickpt.AsyncSave) and h.wait().path.endswith("s")
    finally:
        from unickpt import async_save

        async_save.shutdown()
    target = {"model": {"w": torch.zeros(4), "extra": torch.zeros(1)}}
    with pytest.warns(DeprecationWarning, match=r"load\(strict=False\).*missing='warn'"):
        res = unickpt.load(target, tmp_path / "e", strict=False)
    assert res.missing == ["model/extra"]
    with pytest.warns(DeprecationWarning, match=r"load\(verify=.*LoadOptions\(verify="):
        unickpt.load({"model": {"w": torch.zeros(4)}}, tmp_path / "e", verify="full")
    from unickpt.dcp import StorageWriter

    with pytest.warns(DeprecationWarning, match=r"StorageWriter\(step=.*options=unickpt.SaveOptions"):
        w = StorageWriter(tmp_path / "d", step=3)
    assert w.opts.step == 3
    with pytest.raises(InvalidArgumentError, match="not beside it"):
        StorageWriter(tmp_path / "d", step=3, options=unickpt.SaveOptions())


def test_the_new_forms_raise_no_deprecation_warning(tmp_path):
    sd = {"model": {"w": torch.ones(4)}, "optimizer": {"exp_avg_sq": {"w": torch.ones(4)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        unickpt.save(sd, tmp_path / "a", step=1,
                     options=unickpt.SaveOptions(compression=unickpt.Compression(quant="O1"), extra={"a": 1}))
        unickpt.load({"model": {"w": torch.zeros(4)}}, tmp_path / "a", options=unickpt.LoadOptions(verify="full"))
        from unickpt.dcp import StorageWriter

        StorageWriter(tmp_path / "d", options=unickpt.SaveOptions(step=3))


# -- load semantics --------------------------------------------------------------------------


def test_missing_fails_by_default_and_warn_loads_the_rest(tmp_path):
    unickpt.save({"model": {"a": torch.ones(2)}}, tmp_path / "c")
    t = {"model": {"a": torch.zeros(2), "b": torch.zeros(3)}}
    with pytest.raises(TensorMissingError, match="'b'"):
        unickpt.load(t, tmp_path / "c")
    assert torch.equal(t["model"]["a"], torch.zeros(2))  # refused before anything was read
    res = unickpt.load(t, tmp_path / "c", missing="warn")
    assert res.missing == ["model/b"] and torch.equal(t["model"]["a"], torch.ones(2))
    with pytest.raises(InvalidArgumentError, match="missing"):
        unickpt.load(t, tmp_path / "c", missing="ignore")


def test_unexpected_is_listed_and_ignored_by_default_warned_or_refused(tmp_path, caplog):
    """Loading part of a model (DCP's default): the rest is reported, never silently."""
    import logging

    unickpt.save({"model": {"a": torch.ones(2), "b": torch.ones(3)}}, tmp_path / "c")
    t = {"model": {"a": torch.zeros(2)}}
    res = unickpt.load(t, tmp_path / "c")
    assert res.unexpected == ["model/b"] and torch.equal(t["model"]["a"], torch.ones(2))
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        assert unickpt.load(t, tmp_path / "c", unexpected="warn").unexpected == ["model/b"]
    assert any("not in the target" in m and "model/b" in m for m in caplog.messages), caplog.messages
    with pytest.raises(UnexpectedTensorError, match="model/b"):
        unickpt.load({"model": {"a": torch.zeros(2)}}, tmp_path / "c", unexpected="error")


def test_cast_is_explicit_and_reported(tmp_path):
    w = torch.randn(5, 3)
    unickpt.save({"model": {"w": w, "n": torch.arange(3)}}, tmp_path / "c")
    t = {"model": {"w": torch.zeros(5, 3, dtype=torch.bfloat16), "n": torch.zeros(3, dtype=torch.int64)}}
    with pytest.raises(DtypeMismatchError, match="cast=True"):
        unickpt.load(t, tmp_path / "c")
    res = unickpt.load(t, tmp_path / "c", cast=True)
    assert res.cast == ["model/w: F32 -> torch.bfloat16"] or res.cast[0].startswith("model/w: F32 ->"), res.cast
    assert torch.equal(t["model"]["w"], w.to(torch.bfloat16))
    unickpt.save({"model": {"n": torch.arange(3)}}, tmp_path / "i")
    with pytest.raises(DtypeMismatchError):  # integers are never converted
        unickpt.load({"model": {"n": torch.zeros(3, dtype=torch.int32)}}, tmp_path / "i", cast=True)


def test_bytes_values_round_trip_verbatim_and_are_checksummed(tmp_path):
    blob = pickle.dumps({"epoch": 2, "pos": [1, 2, 3]}) + bytes(range(256))
    unickpt.save({"model": {"w": torch.ones(2)}, "data": {"rank_0": blob, "empty": b""}}, tmp_path / "c")
    t = {"model": {"w": torch.zeros(2)}, "data": {"rank_0": b"", "empty": b"x"}}
    unickpt.load(t, tmp_path / "c")
    assert t["data"] == {"rank_0": blob, "empty": b""} and type(t["data"]["rank_0"]) is bytes
    with pytest.raises(unickpt.errors.StateDictError, match="bytes"):  # bounded: a blob is a small state, not data
        unickpt.save({"data": {"big": bytes(5 << 20)}}, tmp_path / "big")


class _Loader:
    """A stateful data loader whose state is opaque bytes (torchtitan's habit)."""

    def __init__(self, pos):
        self.pos = pos

    def state_dict(self):
        return {"blob": pickle.dumps({"pos": self.pos})}

    def load_state_dict(self, sd):
        self.pos = pickle.loads(sd["blob"])["pos"]


def _per_rank_loader(rank, world, root, mode):
    if mode == "save":
        unickpt.save({"data": unickpt.per_rank(_Loader(100 + rank)), "model": {"w": torch.ones(2)}}, root)
        return None
    ld = _Loader(-1)
    res = unickpt.load({"data": unickpt.per_rank(ld), "model": {"w": torch.zeros(2)}}, root)
    return ld.pos, res.skipped


def test_per_rank_takes_a_stateful_object(tmp_path):
    root = str(tmp_path / "c")
    dist.run(_per_rank_loader, 2, root, "save")
    assert [p for p, _ in dist.run(_per_rank_loader, 2, root, "load")] == [100, 101]
    pos, skipped = _per_rank_loader(0, 1, root, "load")  # another world size: left alone, reported
    assert pos == -1 and skipped, skipped


# -- type checkers see the real types --------------------------------------------------------

USER_SCRIPT = '''
import torch
import unickpt

model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
state = {"model": model, "optim": opt, "step": 0}
res: unickpt.SaveResult = unickpt.save(state, "ckpt/step-1", step=1)
h: unickpt.AsyncSave = unickpt.save_async(
    state, "ckpt/step-2", options=unickpt.SaveOptions(compression=unickpt.Compression(quant="O1")))
done: unickpt.SaveResult = h.wait()
lr: unickpt.LoadResult = unickpt.load(state, "ckpt", options=unickpt.LoadOptions(verify="full"), missing="warn")
ck = unickpt.UnifiedCheckpoint("ckpt", every=10, keep=2, async_save=True)
start: int | None = ck.resume(state)
ck.step(1, state)
ck.close()
'''


def _mypy(tmp_path, text):
    pytest.importorskip("mypy", reason="the test extra installs mypy (pyproject.toml)")
    p = tmp_path / "user.py"
    p.write_text(text)
    env = {**os.environ, "MYPYPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
                           "--cache-dir", str(tmp_path / "cache"), str(p)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)


def test_a_user_script_passes_mypy_strict_and_a_wrong_type_is_caught(tmp_path):
    ok = _mypy(tmp_path, USER_SCRIPT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _mypy(tmp_path, USER_SCRIPT + 'n: int = unickpt.save(state, "x")\nunickpt.load(state, "x", missing="maybe")\n')
    assert bad.returncode == 1 and "SaveResult" in bad.stdout and "missing" in bad.stdout, bad.stdout


# -- the manager in a plain loop -------------------------------------------------------------


def _loop(rank, world, root, total, crash_at, mem, nodes):
    """A plain loop: a module, an optimizer, a scheduler and a data position beside them."""
    if nodes:
        os.environ["UNICKPT_NODE_ID"] = nodes[rank]
    events = []
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    state = {"model": model, "optim": opt, "sched": sched, "data": {"pos": 0}, "blob": b"start"}
    ck = unickpt.UnifiedCheckpoint(root, every=2, keep=2, async_save=True, memory_dir=mem,
                                   memory_replicas=1 if nodes else None, memory_skip_busy=False, on_event=events.append)
    start = ck.resume(state)
    losses = []
    for step in range(start or 0, total):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        ck.wait_for_staging()
        opt.step()
        opt.zero_grad()
        sched.step()
        state["data"]["pos"] = step + 1
        state["blob"] = f"after {step + 1}".encode()
        losses.append(loss.item())
        ck.step(step + 1, state)
        if step + 1 == crash_at:
            ck.wait()
            return start, losses, state["blob"], events  # no close(): as if killed
    ck.close()
    return start, losses, state["blob"], events


def test_a_plain_loop_saves_retains_and_resumes_in_four_calls(tmp_path):
    root = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the manager uses only the new forms
        start, ref, blob, events = _loop(0, 1, root, 6, None, None, None)
        assert start is None and blob == b"after 6"
        saved = [e["step"] for e in events if e["event"] == "save"]
        assert saved == [2, 4, 6], events
        assert sorted(os.listdir(root)) == ["step-00000004", "step-00000006"]  # keep=2
        # a second run: resumes at 6 and has nothing left to do; then one more from 4
        start, losses, blob, _ = _loop(0, 1, root, 6, None, None, None)
        assert (start, losses, blob) == (6, [], b"after 6")
        unickpt.retain(root, 1)
        assert sorted(os.listdir(root)) == ["step-00000006"]


def test_resume_after_a_crash_continues_bit_identically(tmp_path):
    root = str(tmp_path / "ck")
    _, ref, _, _ = _loop(0, 1, str(tmp_path / "ref"), 6, None, None, None)
    _, first, _, _ = _loop(0, 1, root, 6, 3, None, None)  # stops after step 3: durable step 2
    assert first == ref[:3]
    start, rest, blob, events = _loop(0, 1, root, 6, None, None, None)
    assert start == 2 and rest == ref[2:] and blob == b"after 6"
    assert any(e["event"] == "load" and e["tier"] == "durable" and e["step"] == 2 for e in events)


def test_an_elastic_restart_on_fewer_nodes_degrades_its_replicas(tmp_path, caplog):
    """memory_replicas=1 on 2 nodes; the same arguments on 1 node start with a warning and a
    memory_replicas_reduced event instead of refusing (what torchrun --nnodes 1:2 does)."""
    root, mem = str(tmp_path / "ck"), str(tmp_path / "shm")
    out = dist.run(_loop, 2, root, 4, 3, mem, ["n0", "n1"])
    assert all(not any(e["event"] == "memory_replicas_reduced" for e in ev) for *_, ev in out)
    out = dist.run(_loop, 2, root, 5, None, mem, ["n0", "n0"])  # one node left, same arguments
    for start, _, blob, ev in out:
        assert start == 3 and blob == b"after 5"  # from node n0's memory: its own files and n1's replica
        assert [e["tier"] for e in ev if e["event"] == "load"] == ["memory"], ev
        red = [e for e in ev if e["event"] == "memory_replicas_reduced"]
        assert red == [{"event": "memory_replicas_reduced", "wanted": 1, "replicas": 0, "nodes": 1}], ev


def test_the_manager_checks_its_arguments(tmp_path):
    for kw, what in ((dict(every=-1), "every"), (dict(keep=1.5), "keep"), (dict(async_save="yes"), "async_save"),
                     (dict(quant="O3"), "quant"), (dict(memory_dir="s3://b/x"), "memory_dir"),
                     (dict(memory_dir=str(tmp_path), memory_budget="4GiB"), "memory_budget"),
                     (dict(eps=0.0), "eps")):
        with pytest.raises((InvalidArgumentError, ValueError), match=what):
            unickpt.UnifiedCheckpoint(str(tmp_path / "ck"), **kw)


# -- what DCP and torchtitan users do ------------------------------------------------------------


def test_torchtitans_unpadded_step_names_are_steps_and_one_step_has_one_checkpoint(tmp_path):
    m = _model()
    unickpt.save({"model": m}, tmp_path / "step-7")  # torchtitan's spelling records step 7
    unickpt.save({"model": m}, tmp_path / "step-12")
    assert unickpt.latest(tmp_path).endswith("step-12")
    assert unickpt.read_manifest(tmp_path / "step-7")[1].step == 7
    with pytest.raises(unickpt.errors.CheckpointExistsError, match="already committed as step-12"):
        unickpt.save({"model": m}, tmp_path / "step-00000012")
    assert not (tmp_path / "step-00000012").exists()
    import shutil  # planted by hand: which one is step 12 is not guessed

    shutil.copytree(tmp_path / "step-12", tmp_path / "step-00000012")
    with pytest.raises(unickpt.errors.FormatError, match="two committed checkpoints name step 12"):
        unickpt.latest(tmp_path)


def test_empty_containers_of_a_target_are_not_missing_after_a_dcp_save(tmp_path):
    """LambdaLR's ``lr_lambdas`` is ``[{}]`` (torchtitan's schedulers): DCP's flattening keeps
    no trace of empty containers, so the checkpoint cannot hold them; they are not missing."""
    import torch.distributed.checkpoint as dcp

    import unickpt.dcp

    m = _model()
    sd = {"model": m.state_dict(), "sched": {"lr_lambdas": [{}], "last_epoch": 3, "empty": {}}, "blob": b"\x80\x04x"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=unickpt.dcp.StorageWriter(tmp_path / "step-5"))
    t = {"model": _model(1).state_dict(), "sched": {"lr_lambdas": [{}], "last_epoch": 0, "empty": {}}, "blob": b""}
    res = unickpt.load(t, tmp_path)
    assert res.missing == [] and t["sched"]["last_epoch"] == 3 and t["blob"] == b"\x80\x04x"
    t["sched"]["gone"] = [{"x": 1}]  # a value the checkpoint lacks is still missing
    with pytest.raises(TensorMissingError, match="sched.gone"):
        unickpt.load(t, tmp_path)


def test_the_dcp_reader_reports_the_checkpoint_and_its_lossy_generations(tmp_path):
    import torch.distributed.checkpoint as dcp

    import unickpt.dcp

    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    _train(m, opt)
    opts = unickpt.SaveOptions(compression=unickpt.Compression(quant="O1"), lossy_generations=2)
    unickpt.save({"model": m, "optim": opt}, tmp_path / "step-00000003", options=opts)
    r = unickpt.dcp.StorageReader(tmp_path)
    with pytest.raises(InvalidArgumentError, match="nothing read yet"):
        r.lossy_generations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": m.state_dict()}, storage_reader=r)
    assert r.lossy_generations == 3 and r.checkpoint.endswith("step-00000003")


def test_the_dcp_writer_pickles_without_its_group_and_names_bytes_in_its_refusal(tmp_path):
    """Process-mode dcp.async_save pickles the writer into DCP's checkpoint process."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import unickpt.dcp

    w = unickpt.dcp.StorageWriter(tmp_path / "a", options=unickpt.SaveOptions(step=1), process_group=object())
    w._comm = object()
    back = pickle.loads(pickle.dumps(w))
    assert back.process_group is None and back._comm is None and back.opts.step == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(CheckpointException) as ei:  # (a BaseException) failures[rank]: the typed error
            dcp.save({"buf": io.BytesIO(b"x")}, storage_writer=unickpt.dcp.StorageWriter(tmp_path / "b"))
    err = ei.value.failures[0][0]  # (exception, traceback) per rank
    assert isinstance(err, unickpt.errors.StateDictError) and "holds a BytesIO" in str(err), err
    assert "bytes (e.g. pickle.dumps of your own object" in str(err) and "getvalue()" in str(err), err



def test_resume_raises_when_the_state_does_not_fit_instead_of_falling_back_to_an_older_step(tmp_path):
    """A state that does not fit the newest checkpoint (here: fp32 against a bf16 save) would
    not fit an older one either; resuming from one anyway let the next save replace the newer,
    sound checkpoint. Only damage makes way for an older step."""
    from unickpt.errors import DtypeMismatchError

    m = _model().to(torch.bfloat16)
    ck = unickpt.UnifiedCheckpoint(tmp_path, every=2)
    for s in (2, 4):
        ck.step(s, {"model": m})
    ck.close()
    before = unickpt.read_manifest(tmp_path / "step-00000004")[1].created
    again = unickpt.UnifiedCheckpoint(tmp_path, every=2)
    with pytest.raises(DtypeMismatchError):
        again.resume({"model": _model()})  # fp32
    again.close(final_save=False)
    assert unickpt.read_manifest(tmp_path / "step-00000004")[1].created == before
    # damage does make way: the newest step's data flipped, the older one is resumed
    f = next((tmp_path / "step-00000004").glob("model-*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    third = unickpt.UnifiedCheckpoint(tmp_path, every=2)
    assert third.resume({"model": _model().to(torch.bfloat16)}) == 2
    third.close(final_save=False)


@pytest.mark.parametrize("call", [
    lambda p: unickpt.UnifiedCheckpoint(""),
    lambda p: unickpt.UnifiedCheckpoint(None),
    lambda p: unickpt.UnifiedCheckpoint(p, storage_options="x"),
    lambda p: unickpt.UnifiedCheckpoint(p, timeout_s=-1),
    lambda p: unickpt.UnifiedCheckpoint(p, timeout_s=float("nan")),
    lambda p: unickpt.UnifiedCheckpoint(p, on_event=5),
    lambda p: unickpt.UnifiedCheckpoint(p, memory_dir=123),
    lambda p: unickpt.UnifiedCheckpoint(p / "shm" / "ckpt", memory_dir=p / "shm"),
    lambda p: unickpt.load({}, p, options=unickpt.SaveOptions()),
    lambda p: unickpt.load({}, p, progress=5),
    lambda p: unickpt.load({}, None),
    lambda p: unickpt.latest(5),
    lambda p: unickpt.LoadOptions(storage_options="x"),
    lambda p: unickpt.partition_flat([(4,)], 0, 0),
    lambda p: unickpt.partition_flat([(4,)], 2, 3),
    lambda p: unickpt.partition_flat("abc", 2, 0),
    lambda p: unickpt.load_for_inference(p, dtype=torch.int8),
    lambda p: unickpt.load_for_inference(p, dtype="bf16"),
    lambda p: unickpt.load_for_inference(p, keys="weight"),
    lambda p: unickpt.load_for_inference(p, tp_dim=5),
    lambda p: unickpt.load_for_inference(p, device="tpu"),
    lambda p: unickpt.save_async({"w": torch.ones(2)}, p / "a", also=str(p / "b")),
    lambda p: unickpt.SaveOptions(step=-1),
    lambda p: unickpt.dcp.StorageReader(p, timeout_s=-1),
], ids=lambda f: "")
def test_bad_arguments_get_typed_errors_when_given(tmp_path, call):
    """Every public argument is checked where it is given (not at first use), with a
    unickpt error naming it (a new user's attack on docs/api.md's surface)."""
    import unickpt.dcp  # noqa: F401

    with pytest.raises(unickpt.errors.UnickptError):
        call(tmp_path)


def test_steps_only_go_forward_and_a_closed_manager_is_done(tmp_path):
    ck = unickpt.UnifiedCheckpoint(tmp_path, every=1)
    m = _model()
    ck.step(5, {"model": m})
    with pytest.raises(InvalidArgumentError, match="steps only go forward"):
        ck.step(3, {"model": m})
    ck.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        ck.step(6, {"model": m})
    assert unickpt.latest(tmp_path).endswith("step-00000005")
