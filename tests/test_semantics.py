"""What a PyTorch user expects of a checkpoint library (issue #12): stateful objects (modules,
optimizers, schedulers) saved and restored as torch.distributed.checkpoint does, fresh
optimizers included; honest key accounting (missing and unexpected tensors); per-rank
values; plain tensors that differ between ranks refused; tied weights stored once."""

import json
import os

import pytest
import torch
import xxhash
from safetensors import safe_open

import unickpt
from tests.clirun import cli
from tests import dist
from tests.hf_models import fsdp, llama
from unickpt.errors import ShapeMismatchError, StateDictError, TensorMissingError, UnexpectedTensorError


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _train(model, opt, sched=None, steps=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or set(sa["state"]) != set(sb["state"]):
        return False
    for i, st in sa["state"].items():
        if set(st) != set(sb["state"][i]):
            return False
        for k, v in st.items():
            w = sb["state"][i][k]
            if isinstance(v, torch.Tensor) != isinstance(w, torch.Tensor):
                return False
            if isinstance(v, torch.Tensor) and not torch.equal(v, w) or not isinstance(v, torch.Tensor) and v != w:
                return False
    return True


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    lambda p: torch.optim.Adafactor(p, lr=1e-2),
], ids=["adamw", "sgd-momentum", "adafactor"])
def test_fresh_optimizer_gets_moments_step_and_param_groups(tmp_path, make):
    model, opt = _mlp(), None
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, sched)
    unickpt.save({"model": model, "optim": opt, "sched": sched}, tmp_path / "ck")

    model2 = _mlp(seed=1)
    opt2 = make(model2.parameters())
    for g in opt2.param_groups:
        g["lr"] = 123.0  # must not survive the load
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    assert not opt2.state
    res = unickpt.load({"model": model2, "optim": opt2, "sched": sched2}, tmp_path / "ck")
    assert res.missing == [] and res.unexpected == [] and res.tensors > 4
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert _same_optimizer_state(opt, opt2)
    assert sched2.state_dict() == sched.state_dict()
    # and training goes on identically
    _train(model, opt, sched, steps=2, seed=9)
    _train(model2, opt2, sched2, steps=2, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_an_optimizer_alone_is_saved_by_parameter_number_and_restored(tmp_path):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train(model, opt)
    unickpt.save({"optimizer": opt}, tmp_path / "ck")
    opt2 = torch.optim.AdamW(_mlp(seed=2).parameters(), lr=1.0)
    unickpt.load({"optimizer": opt2}, tmp_path / "ck")
    assert _same_optimizer_state(opt, opt2)


def test_an_optimizer_saved_before_its_first_step_is_restored_without_state(tmp_path):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.25)
    unickpt.save({"model": model, "optim": opt}, tmp_path / "ck")
    assert not opt.state  # saving did not create state
    model2 = _mlp(seed=3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    res = unickpt.load({"model": model2, "optim": opt2}, tmp_path / "ck")
    assert res.missing == [] and not opt2.state and opt2.param_groups[0]["lr"] == 0.25


def test_a_fresh_optimizer_state_dict_is_not_a_silent_no_op(tmp_path, caplog):
    """The finding: loading into ``fresh_optimizer.state_dict()`` loaded 0 tensors and said
    nothing. Now the moments are named as unexpected (strict) or listed (not strict)."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    unickpt.save({"optimizer": opt.state_dict()}, tmp_path / "ck")
    fresh = torch.optim.AdamW(_mlp().parameters()).state_dict()
    with pytest.raises(UnexpectedTensorError, match=r"optimizer/state\.0\.exp_avg.*pass the optimizer object") as ei:
        unickpt.load({"optimizer": fresh}, tmp_path / "ck", unexpected="error")
    assert "optimizer/state.0.exp_avg_sq" in ei.value.unexpected and ei.value.missing == []
    # DCP's default ignores them, listed in the result, and says so in the log: none was loaded
    import logging

    with caplog.at_level(logging.WARNING, logger="unickpt"):
        res = unickpt.load({"optimizer": fresh}, tmp_path / "ck")
    lines = caplog.messages
    assert res.tensors == 0 and len(res.unexpected) == 12  # 4 parameters x (step, exp_avg, exp_avg_sq)
    assert any("none of the 12 tensor(s) of role 'optimizer'" in x and "pass the optimizer object" in x for x in lines), lines


def test_an_optimizer_object_saved_by_dcp_loads_into_an_optimizer_object(tmp_path):
    """dcp.save calls ``optimizer.state_dict()`` (parameters numbered); unickpt.load with the
    optimizer object reads that form back instead of expecting parameter names."""
    import torch.distributed.checkpoint as dcp

    from unickpt.dcp import StorageWriter

    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt)
    dcp.save({"model": model, "optim": opt}, storage_writer=StorageWriter(tmp_path / "ck"), no_dist=True)
    model2 = _mlp(seed=4)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1.0)
    res = unickpt.load({"model": model2, "optim": opt2}, tmp_path / "ck")
    assert res.missing == [] and res.unexpected == [] and _same_optimizer_state(opt, opt2)


def test_top_level_json_values_beside_stateful_objects_are_restored(tmp_path):
    """The README's own use: a module, an optimizer and a scheduler beside plain values in
    one dict. The plain values at the top level (an int, a string, a list) are restored into
    the caller's dict as they are without objects; nested ones were already."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    _train(model, opt, sched)
    unickpt.save({"model": model, "optim": opt, "sched": sched, "step": 100, "tag": "run-a", "seen": [3, 5],
                  "trainer": {"tokens": 7}}, tmp_path / "step-00000100", step=100)
    m2 = _mlp(1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 2)
    st = {"model": m2, "optim": o2, "sched": s2, "step": 0, "tag": "", "seen": [], "trainer": {"tokens": 0}}
    res = unickpt.load(st, tmp_path)
    assert (st["step"], st["tag"], st["seen"], st["trainer"]) == (100, "run-a", [3, 5], {"tokens": 7})
    assert st["model"] is m2 and st["optim"] is o2 and st["sched"] is s2  # the objects stay, loaded
    assert not res.missing and not res.skipped and _same_optimizer_state(opt, o2)
    assert s2.state_dict() == sched.state_dict()


def test_saved_lists_longer_than_the_target_are_loaded_whole_or_reported(tmp_path):
    """A list of lists of plain values loads whole, as a flat list does (dcp.load through
    unickpt's reader agrees); a list of dicts is filled item by item, and saved items beyond
    the target's length are reported in ``skipped``, never dropped silently."""
    unickpt.save({"model": {"w": torch.ones(2)}, "trainer": {"buckets": [[1, 2], [3, 4, 5]], "groups": [{"a": 1}, {"a": 2}]}},
                 tmp_path / "ck")
    st = {"model": {"w": torch.zeros(2)}, "trainer": {"buckets": [[0]], "groups": [{"a": 0}]}}
    res = unickpt.load(st, tmp_path / "ck")
    assert st["trainer"] == {"buckets": [[1, 2], [3, 4, 5]], "groups": [{"a": 1}]}
    assert len(res.skipped) == 1 and res.skipped[0].startswith("trainer.groups: 1 saved items"), res.skipped


def test_json_values_the_checkpoint_lacks_are_missing(tmp_path):
    unickpt.save({"step": 3, "model": {"w": torch.ones(2)}}, tmp_path / "ck")
    target = {"step": 0, "epoch": 7, "trainer": {"x": 1}, "model": {"w": torch.zeros(2)}}
    with pytest.raises(TensorMissingError, match="epoch.*trainer|not in the checkpoint") as ei:
        unickpt.load(target, tmp_path / "ck")
    assert sorted(ei.value.missing) == ["epoch", "trainer"]
    res = unickpt.load(target, tmp_path / "ck", strict=False)
    assert sorted(res.missing) == ["epoch", "trainer"] and target["step"] == 3 and target["epoch"] == 7


class _Counter:
    """A user's Stateful holding a per-rank value."""

    def __init__(self, n):
        self.n = n

    def state_dict(self):
        return {"n": unickpt.per_rank(self.n), "t": unickpt.per_rank(torch.tensor([self.n]))}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        assert torch.equal(sd["t"], torch.tensor([self.n]))


def test_a_stateful_gets_back_the_values_it_wrapped_in_per_rank(tmp_path):
    unickpt.save({"counter": _Counter(41)}, tmp_path / "ck")
    c = _Counter(0)
    unickpt.load({"counter": c}, tmp_path / "ck")
    assert c.n == 41


def test_a_crafted_per_rank_list_cannot_claim_another_world_size(tmp_path):
    from unickpt.manifest import Manifest

    unickpt.save({"pos": unickpt.per_rank(5), "model": {"w": torch.ones(1)}}, tmp_path / "ck")
    raw = json.loads((tmp_path / "ck" / "unickpt.json").read_bytes())
    raw.pop("manifest_xxh3_128")
    for bad in ([5, 6], 5, {"x": 1}):
        raw["state"]["pos"] = {"__unickpt_per_rank__": bad}
        body = json.dumps(raw, separators=(",", ":")).encode()  # re-sealed: the attacker recomputes the checksum
        data = body[:-1] + b',"manifest_xxh3_128":"' + xxhash.xxh3_128_hexdigest(body).encode() + b'"}'
        with pytest.raises(unickpt.errors.FormatError, match="one value per saving rank"):
            Manifest.from_json(data, "crafted")


def test_missing_and_unexpected_are_both_reported(tmp_path):
    unickpt.save({"model": {"a": torch.ones(2), "b": torch.ones(3)}, "optimizer": {"m": torch.ones(1)}},
                 tmp_path / "ck")
    target = {"model": {"a": torch.zeros(2), "c": torch.zeros(4)}}
    with pytest.raises(TensorMissingError) as ei:
        unickpt.load(target, tmp_path / "ck", unexpected="error")
    assert ei.value.missing == ["model/c"] and ei.value.unexpected == ["model/b"]
    assert "model/b" in str(ei.value)
    assert torch.equal(target["model"]["a"], torch.zeros(2))  # refused: nothing filled
    with pytest.raises(TensorMissingError) as ei:  # the default: missing keys fail, unexpected are not named
        unickpt.load(target, tmp_path / "ck")
    assert ei.value.missing == ["model/c"] and ei.value.unexpected == []
    res = unickpt.load(target, tmp_path / "ck", missing="warn")
    # the optimizer role is not named by the target: its tensors are not "unexpected"
    assert res.missing == ["model/c"] and res.unexpected == ["model/b"]
    assert torch.equal(target["model"]["a"], torch.ones(2))


def test_tied_weights_are_stored_once_and_restored_under_every_name(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    unickpt.save({"model": model.state_dict()}, tmp_path / "ck")
    _, man = unickpt.read_manifest(tmp_path / "ck")
    assert man.aliases == {("model", "lm_head.weight"): "transformer.wte.weight"}
    names = []
    for f in man.files:
        with safe_open(str(tmp_path / "ck" / f), "pt") as s:
            names += list(s.keys())
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    # a tied target: one read fills both names
    torch.manual_seed(1)
    tied = AutoModelForCausalLM.from_config(cfg)
    res = unickpt.load({"model": tied.state_dict()}, tmp_path / "ck")
    assert res.unexpected == [] and res.missing == []
    assert torch.equal(tied.lm_head.weight, model.lm_head.weight) and tied.lm_head.weight is tied.transformer.wte.weight
    # an untied target (separate tensors) gets the stored values under both names
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    unickpt.load({"model": sd}, tmp_path / "ck")
    assert torch.equal(sd["lm_head.weight"], model.transformer.wte.weight)
    assert torch.equal(sd["transformer.wte.weight"], model.transformer.wte.weight)
    # the inference loader returns both names, as one tensor
    w = unickpt.load_for_inference(tmp_path / "ck")
    assert w["lm_head.weight"] is w["transformer.wte.weight"]
    # and dcp.load through the unickpt reader sees every tied name
    import torch.distributed.checkpoint as dcp

    from unickpt.dcp import StorageReader, StorageWriter

    sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(sd, storage_reader=StorageReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(sd["model"]["lm_head.weight"], model.transformer.wte.weight)
    # dcp.save through the unickpt writer stores them once too
    dcp.save({"model": model.state_dict()}, storage_writer=StorageWriter(tmp_path / "dcp"), no_dist=True)
    assert unickpt.read_manifest(tmp_path / "dcp")[1].aliases == {("model", "lm_head.weight"): "transformer.wte.weight"}


def test_per_rank_values_round_trip_on_one_process_and_are_refused_elsewhere(tmp_path):
    rng = torch.get_rng_state()
    sd = {"rng": unickpt.per_rank(rng.clone()), "data": unickpt.per_rank({"epoch": 2, "index": [5, 6]}),
          "model": {"w": torch.ones(3)}}
    unickpt.save(sd, tmp_path / "ck")
    _, man = unickpt.read_manifest(tmp_path / "ck")
    assert man.per_rank == {("other", "rng")} and man.tensors[("other", "rng")].shape == (1, rng.numel())
    back = {"rng": unickpt.per_rank(torch.zeros_like(rng)), "data": unickpt.per_rank(None), "model": {"w": torch.zeros(3)}}
    res = unickpt.load(back, tmp_path / "ck")
    assert torch.equal(back["rng"].value, rng) and back["data"].value == {"epoch": 2, "index": [5, 6]}
    assert res.skipped == []
    with pytest.raises(ShapeMismatchError, match="once per rank.*per_rank"):
        unickpt.load({"rng": torch.zeros_like(rng)}, tmp_path / "ck")
    with pytest.raises(StateDictError, match="reserved"):
        unickpt.save({"x": {"__unickpt_per_rank__": 1}}, tmp_path / "bad")
    with pytest.raises(StateDictError, match="per_rank"):
        unickpt.per_rank(object())


def _per_rank_save(rank, world, root):
    torch.manual_seed(100 + rank)  # every rank its own RNG stream
    sd = {"rng": unickpt.per_rank(torch.get_rng_state()), "pos": unickpt.per_rank({"index": 10 * rank}),
          "model": {"w": torch.arange(4.0)}}
    unickpt.save(sd, os.path.join(root, "pr"))
    # a plain tensor that differs between ranks is refused on every rank, naming it
    try:
        unickpt.save({"model": {"w": torch.arange(4.0)}, "seed": torch.tensor([rank])}, os.path.join(root, "bad"))
        refused = None
    except StateDictError as e:
        refused = str(e)
    # JSON values that differ are refused too (one value is saved for all ranks), naming the path
    try:
        unickpt.save({"trainer": {"step": 5, "data_position": 1000 * rank}}, os.path.join(root, "bad-json"))
        refused_json = None
    except StateDictError as e:
        refused_json = str(e)
    # per_rank tensors must have one shape
    try:
        unickpt.save({"buf": unickpt.per_rank(torch.arange(rank + 2))}, os.path.join(root, "bad-shape"))
        refused_shape = None
    except StateDictError as e:
        refused_shape = str(e)
    assert refused_json and "trainer.data_position" in refused_json, refused_json
    assert refused_shape and "same shape" in refused_shape and "[2]" in refused_shape, refused_shape
    # the same through the asynchronous writer: the error surfaces from wait()
    h = unickpt.save({"noise": torch.full((3,), float(rank))}, os.path.join(root, "bad-async"), async_save=True)
    try:
        h.wait()
        refused_async = None
    except unickpt.errors.UnickptError as e:
        refused_async = str(e)
    # a state dict only rank 0 fills (get_state_dict(full_state_dict=True, cpu_offload=True)): named as such
    full = {"model": {"w": torch.ones(2)}, "optim": {"param_groups": [{"lr": 0.1}]}} if rank == 0 else \
        {"model": {}, "optim": {}}
    try:
        unickpt.save(full, os.path.join(root, "full"))
        refused_full = None
    except StateDictError as e:
        refused_full = str(e)
    assert refused_full and "rank 0 holds the JSON value 'optim' and rank 1 does not" in refused_full, refused_full
    if rank == 0:  # the way it says
        unickpt.save(full, os.path.join(root, "full"), group="local")
    said = []
    for state in ({"o": {"param_groups": [{"lr": 1}] * (rank + 1)}},  # another number of items
                  {"trainer": {"v": float("inf") if rank == 0 else float("nan")}},  # NaN/inf named as values
                  {"trainer": {"z": 0.0 if rank == 0 else -0.0}}):  # stored differently: named too
        try:
            unickpt.save(state, os.path.join(root, "shape"))
        except StateDictError as e:
            said.append(str(e))
    assert "the JSON list 'o.param_groups' holds 1 item(s) on rank 0 and 2 on rank 1" in said[0], said
    assert "the JSON value 'trainer.v' differs between ranks" in said[1], said
    assert "the JSON value 'trainer.z' differs between ranks" in said[2], said
    # a tensor one rank holds on the host and another on an accelerator (simulated: rank 1
    # fingerprints it as it would on a device, a weighted sum instead of xxh3): equal values
    # save, different ones are still refused
    from unickpt.saving import checks

    was = checks._on_device
    if rank == 1:
        checks._on_device = lambda t: True
    try:
        unickpt.save({"model": {"w": torch.arange(4096.0), "b": torch.arange(4097.0).bfloat16()[1:]}},
                     os.path.join(root, "mixed"))  # (b: a view at an odd offset, fingerprinted aligned)
        try:
            unickpt.save({"model": {"w": torch.arange(4096.0) + (rank == 1)}}, os.path.join(root, "mixed2"))
            mixed_refused = None
        except StateDictError as e:
            mixed_refused = str(e)
    finally:
        checks._on_device = was
    assert mixed_refused and "rank 0 holds one value, rank 1 another" in mixed_refused, mixed_refused
    assert not os.path.exists(os.path.join(root, "mixed2"))
    return torch.get_rng_state().tolist(), refused, refused_async, os.path.exists(os.path.join(root, "bad"))


def _per_rank_load(rank, world, root):
    back = {"rng": unickpt.per_rank(torch.zeros(5056, dtype=torch.uint8)), "pos": unickpt.per_rank(None),
            "model": {"w": torch.zeros(4)}}
    res = unickpt.load(back, os.path.join(root, "pr"))
    return back["rng"].value.tolist(), back["pos"].value, res.skipped


def test_per_rank_values_and_divergent_plain_tensors_on_two_ranks(tmp_path):
    root = str(tmp_path)
    out = dist.run(_per_rank_save, 2, root)
    rngs = [o[0] for o in out]
    assert rngs[0] != rngs[1]
    for _, refused, refused_async, exists in out:
        assert refused and "'seed'" in refused and "unickpt.per_rank" in refused and "rank 0 holds one value, rank 1 another" in refused
        assert refused_async and "'noise'" in refused_async
        assert not exists
    back = dist.run(_per_rank_load, 2, root)
    for rank, (rng, pos, skipped) in enumerate(back):
        assert rng == rngs[rank] and pos == {"index": 10 * rank} and skipped == []
    # another world size: nothing restored, and said so
    target = {"rng": unickpt.per_rank(torch.zeros(5056, dtype=torch.uint8)), "pos": unickpt.per_rank("keep"),
              "model": {"w": torch.zeros(4)}}
    res = unickpt.load(target, os.path.join(root, "pr"))
    assert target["pos"].value == "keep" and not target["rng"].value.any()
    assert sorted(s.split(":")[0] for s in res.skipped) == ["other/rng", "pos"]
    assert all("saved by 2 ranks" in s for s in res.skipped)
    assert torch.equal(target["model"]["w"], torch.arange(4.0))
    man = json.loads((tmp_path / "pr" / "unickpt.json").read_bytes())
    assert man["per_rank"] == {"other": ["rng"]}


# -- FSDP2 / TP models from transformers configs, through stateful objects ---------------

def _llama_steps(model, opt, steps, seed=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(sd):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in sd.items()}


def _llama_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model/{k}": v for k, v in _full(msd).items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out, osd["param_groups"]


def _fsdp_save(rank, world, root):
    model = fsdp(llama(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _llama_steps(model, opt, 2)
    unickpt.save({"model": model, "optim": opt}, os.path.join(root, "llama"), step=2)
    state, groups = _llama_state(model, opt)
    losses = _llama_steps(model, opt, 2, seed=11)
    return ({k: v.tolist() for k, v in state.items()}, groups, losses) if rank == 0 else None


def _fsdp_resume(rank, world, root):
    model = fsdp(llama(seed=5), world) if world > 1 else llama(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # fresh: no state; lr overwritten by the load
    res = unickpt.load({"model": model, "optim": opt}, os.path.join(root, "llama"))
    state, groups = _llama_state(model, opt)
    losses = _llama_steps(model, opt, 2, seed=11)
    return ({k: v.tolist() for k, v in state.items()}, groups, losses, res.unexpected, res.missing) if rank == 0 else None


def test_fsdp2_llama_resumes_bit_exact_on_one_and_four_ranks_through_stateful_objects(tmp_path):
    root = str(tmp_path)
    want, groups, losses = dist.run(_fsdp_save, 2, root, timeout=300)[0]
    assert any(k.endswith("/exp_avg") for k in want) and any(k.endswith("/step") for k in want)
    for world in (1, 4):
        got, g2, l2, unexpected, missing = (dist.run(_fsdp_resume, world, root, timeout=300)[0] if world > 1
                                            else _fsdp_resume(0, 1, root))
        assert unexpected == [] and missing == []
        assert set(got) == set(want)
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, (world, bad[:5])
        assert g2 == groups
        # training goes on from the same state (other world sizes reduce gradients in another order)
        assert l2 == pytest.approx(losses, rel=1e-4), world


def _tp_save(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    _train(model, opt, sched)
    unickpt.save({"model": model, "optim": opt, "sched": sched}, os.path.join(root, "tp"))
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in model.state_dict().items()}
    moments = {}
    for p, st in zip(model.parameters(), opt.state.values()):
        moments[len(moments)] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in st.items()}
    return full, moments, opt.param_groups[0]["lr"]


def test_tensor_parallel_objects_resume_in_one_plain_process(tmp_path):
    root = str(tmp_path)
    full, moments, lr = dist.run(_tp_save, 2, root)[0]
    model = _mlp(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    res = unickpt.load({"model": model, "optim": opt, "sched": sched}, os.path.join(root, "tp"))
    assert res.missing == [] and res.unexpected == []
    assert all(torch.equal(v, torch.tensor(full[k])) for k, v in model.state_dict().items())
    got = [opt.state[p] for p in model.parameters()]
    for i, st in moments.items():
        for k, v in st.items():
            assert torch.equal(got[i][k], torch.tensor(v)), (i, k)
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 3


# -- key accounting: what a load cannot restore is reported, never dropped (attacker review 2026-11-28)


def test_a_shorter_top_level_list_of_tensors_reports_the_saved_tensors_beyond_it(tmp_path):
    unickpt.save({"bufs": [torch.ones(2), torch.ones(3), torch.ones(4)]}, tmp_path / "c")
    with pytest.raises(UnexpectedTensorError, match="other/bufs.2"):
        unickpt.load({"bufs": [torch.zeros(2), torch.zeros(3)]}, tmp_path / "c", unexpected="error")
    res = unickpt.load({"bufs": [torch.zeros(2), torch.zeros(3)]}, tmp_path / "c")
    assert res.unexpected == ["other/bufs.2"]


def test_tuples_holding_tensors_get_their_other_values_back(tmp_path):
    import collections

    Pair = collections.namedtuple("Pair", "w n")
    unickpt.save({"m": {"pair": (torch.ones(3), 5, {"a": 7}), "nt": Pair(torch.ones(2), 9)}, "x": (torch.ones(1), 3)},
                 tmp_path / "c")
    t = {"m": {"pair": (torch.zeros(3), 0, {"a": 0}), "nt": Pair(torch.zeros(2), 0)}, "x": (torch.zeros(1), 0)}
    w, nw = t["m"]["pair"][0], t["m"]["nt"].w
    res = unickpt.load(t, tmp_path / "c")
    assert t["m"]["pair"][1:] == (5, {"a": 7}) and t["m"]["pair"][0] is w and torch.equal(w, torch.ones(3))
    assert type(t["m"]["nt"]) is Pair and t["m"]["nt"].n == 9 and t["m"]["nt"].w is nw and torch.equal(nw, torch.ones(2))
    assert t["x"][1] == 3 and torch.equal(t["x"][0], torch.ones(1))
    assert (res.missing, res.unexpected, res.skipped) == ([], [], [])


def test_tuples_without_tensors_come_back_as_the_targets_kinds(tmp_path):
    """JSON stores tuples as lists; a load gives back the target's kinds: tuples, namedtuples
    and tuples inside lists and dicts (a list stays a list)."""
    import collections

    Pt = collections.namedtuple("Pt", "x y")
    saved = {"w": torch.ones(1), "meta": {"betas": (0.9, 0.99), "pt": Pt(1, 2), "pairs": [(1, 2), (3, 4)],
                                          "nest": {"t": ((1, 2), [3])}, "l": [5, 6], "odd": (1, 2, 3)}}
    unickpt.save(saved, tmp_path / "c")
    t = {"w": torch.zeros(1), "meta": {"betas": (0.0, 0.0), "pt": Pt(0, 0), "pairs": [(0, 0), (0, 0)],
                                       "nest": {"t": ((0, 0), [0])}, "l": [0, 0], "odd": (0,)}}
    unickpt.load(t, tmp_path / "c")
    m = t["meta"]
    assert m["betas"] == (0.9, 0.99) and type(m["betas"]) is tuple
    assert type(m["pt"]) is Pt and m["pt"] == Pt(1, 2)
    assert m["pairs"] == [(1, 2), (3, 4)] and all(type(p) is tuple for p in m["pairs"])
    assert m["nest"]["t"] == ((1, 2), [3]) and type(m["nest"]["t"][1]) is list
    assert m["l"] == [5, 6] and type(m["l"]) is list
    assert m["odd"] == (1, 2, 3)  # another length: still a tuple


def test_infinities_and_nan_in_json_state_round_trip_reduce_lr_on_plateau_included(tmp_path):
    """Strict JSON has no NaN or infinity; ReduceLROnPlateau's state holds inf from the start
    (best, mode_worse). They are stored as {"__unickpt_float__": "inf"} and come back as
    floats, through unickpt.load and the DCP reader, per-rank values included."""
    import math

    import torch.distributed.checkpoint as dcp

    from unickpt import dcp as udcp

    def job():
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)

    model, opt, sched = job()
    sd = {"model": model, "optim": opt, "sched": sched,
          "meta": {"lo": -math.inf, "n": math.nan, "l": [math.inf, 1.0], "t": (math.inf,)},
          "pos": unickpt.per_rank({"best": math.inf})}
    unickpt.save(sd, tmp_path / "a")  # best is still inf
    sched.step(2.0), sched.step(3.0)  # best 2.0, the lr cut once
    unickpt.save(sd, tmp_path / "b")
    for path, ref in (("a", {"best": math.inf}), ("b", sched.state_dict())):
        m2, o2, s2 = job()
        t = {"model": m2, "optim": o2, "sched": s2, "meta": {"lo": 0.0, "n": 0.0, "l": [0.0, 0.0], "t": (0.0,)},
             "pos": unickpt.per_rank(None)}
        res = unickpt.load(t, tmp_path / path)
        assert (res.missing, res.skipped) == ([], [])
        assert all(s2.state_dict()[k] == v for k, v in ref.items()), (s2.state_dict(), ref)
        m = t["meta"]
        assert m["lo"] == -math.inf and math.isnan(m["n"]) and m["l"] == [math.inf, 1.0] and m["t"] == (math.inf,)
        assert t["pos"].value == {"best": math.inf}
    assert s2.state_dict() == sched.state_dict() and o2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    via = {"meta": {"lo": 0.0, "n": 0.0, "l": [0.0, 0.0], "t": (0.0,)}}
    dcp.load(via, storage_reader=udcp.StorageReader(tmp_path / "b"))
    assert via["meta"]["lo"] == -math.inf and math.isnan(via["meta"]["n"]) and via["meta"]["t"] == (math.inf,)
    dcp.save({"w": torch.ones(1), "meta": {"x": math.inf}}, storage_writer=udcp.StorageWriter(tmp_path / "c"))
    back = {"w": torch.zeros(1), "meta": {"x": 0.0}}
    unickpt.load(back, tmp_path / "c")
    assert back["meta"]["x"] == math.inf
    with pytest.raises(StateDictError, match="reserved"):
        unickpt.save({"meta": {"__unickpt_float__": "inf"}}, tmp_path / "d")


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {"__unickpt_float__": "inf"}, "INF", 1, None, "extra"])
def test_a_crafted_float_code_in_the_manifest_is_a_format_error(tmp_path, bad):
    """{"__unickpt_float__": ...} is reserved for "inf", "-inf", "nan" alone: anything else in
    a manifest is refused when it is read (load, inspect, verify, reshard), typed."""
    import json

    from tests.crafted import seal
    from unickpt.errors import FormatError

    unickpt.save({"w": torch.ones(1), "meta": {"x": float("inf"), "l": [1.0]}}, tmp_path / "c")
    m = tmp_path / "c" / "unickpt.json"
    obj = json.loads(m.read_bytes())
    obj["state"]["meta"]["l"] = [{"__unickpt_float__": bad} if bad != "extra" else {"__unickpt_float__": "inf", "b": 1}]
    m.write_bytes(seal(obj))
    with pytest.raises(FormatError, match="reserved for"):
        unickpt.load({"w": torch.zeros(1), "meta": {"x": 0.0, "l": [0.0]}}, tmp_path / "c")
    r = cli("verify", tmp_path / "c", "-q")
    assert r.returncode == 2 and "reserved for" in r.stderr, r.stderr


def test_reserved_keys_are_refused_anywhere_and_infinities_replace_what_the_target_holds(tmp_path):
    import math

    for bad in ({"l": [{"__unickpt_float__": "inf"}]}, {"t": ({"__unickpt_per_rank__": [1]},)},
                {"p": unickpt.per_rank({"__unickpt_float__": "inf"})}):
        with pytest.raises(StateDictError, match="reserved"):
            unickpt.save({"meta": bad}, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    unickpt.save({"trainer": {"d": math.inf, "ld": math.inf}}, tmp_path / "c")
    t = {"trainer": {"d": {"a": 1}, "ld": [{"a": 1}]}}
    res = unickpt.load(t, tmp_path / "c")  # a saved value replaces the target's whole, as 5.0 would
    assert t["trainer"] == {"d": math.inf, "ld": math.inf} and (res.missing, res.skipped) == ([], [])


def test_json_state_a_manifest_cannot_hold_is_refused_before_writing_and_dense_state_loads(tmp_path):
    """What a save commits, a load parses: dense JSON state (a list of small lists, brackets in
    strings) saves and loads; state beyond what a manifest may hold, top-level reserved keys,
    text that is not valid Unicode, integers a JSON reader cannot read and nesting deeper than
    MAX_DEPTH are StateDictErrors before anything is written (they once committed checkpoints
    no load could read, or failed untyped)."""
    from unickpt.state import MAX_DEPTH

    dense = {"model": {"w": torch.ones(2)}, "data": {"seen": [[0, i % 10] for i in range(3000)],
                                                     "text": str([[i % 3] for i in range(2000)])}}
    unickpt.save(dense, tmp_path / "dense", extra={"template": "{x}{y}" * 1000})
    back = {"model": {"w": torch.zeros(2)}, "data": {"seen": [], "text": ""}}
    res = unickpt.load(back, tmp_path / "dense")
    assert back["data"] == dense["data"] and res.extra["template"] == "{x}{y}" * 1000
    assert cli("verify", tmp_path / "dense", "-q").returncode == 0
    deep = 0
    for _ in range(MAX_DEPTH - 3):
        deep = [deep]
    unickpt.save({"trainer": {"x": deep}}, tmp_path / "deep")  # (as deep as allowed: loads)
    got = {"trainer": {"x": None}}
    unickpt.load(got, tmp_path / "deep")
    assert got["trainer"]["x"] == deep
    too_deep = [deep] * 1
    for _ in range(5):
        too_deep = [too_deep]
    cases = {
        "too dense": ({"data": {"seen": [[0] for _ in range(150_000)]}}, {}, "more than a checkpoint's manifest"),
        "top-level reserved": ({"__unickpt_float__": "inf", "step": 5}, {}, "top-level key '__unickpt_float__' is reserved"),
        "top-level rank value": ({"__unickpt_rank_value__": 1}, {}, "is reserved"),
        "surrogate value": ({"trainer": {"name": "bad\udc80"}}, {}, "not valid Unicode"),
        "surrogate key": ({"trainer": {"k\udc80": 1}}, {}, "not valid Unicode"),
        "surrogate tensor name": ({"model": {"w\udc80": torch.ones(1)}}, {}, "not valid Unicode"),
        "surrogate in extra": ({"w": torch.ones(1)}, {"extra": {"n": "x\udc80"}}, "not valid Unicode"),
        "huge int": ({"trainer": {"x": 10 ** 5000}}, {}, "too large to store as JSON"),
        "huge int key": ({"trainer": {10 ** 5000: 1}}, {}, "integer key of 16610 bits"),
        "huge step": ({"w": torch.ones(1)}, {"step": 10 ** 5000}, "step must be an int"),
        "surrogate in an extra file": ({"w": torch.ones(1)}, {"extra_files": {"notes.txt": "caf\udce9"}},
                                       "not valid Unicode"),
        "bracket tensor names": ({"model": {"[" * 4000 + str(i): torch.ones(1) for i in range(70)}}, {},
                                 "tensor names hold"),
        "too deep": ({"trainer": {"x": too_deep}}, {}, f"nested deeper than {MAX_DEPTH} levels"),
        "too deep extra": ({"w": torch.ones(1)}, {"extra": {"x": too_deep}}, f"nested deeper than {MAX_DEPTH}"),
    }
    for name, (state, kw, msg) in cases.items():
        with pytest.raises(StateDictError, match=msg):
            unickpt.save(state, tmp_path / "bad", **kw)
        assert not (tmp_path / "bad").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")], name


@pytest.mark.parametrize("case", ["state null", "state a list", "state a float code", "state too deep"])
def test_a_manifest_with_state_no_save_writes_is_a_format_error(tmp_path, case):
    import json

    from tests.crafted import seal, seal_text
    from unickpt.errors import FormatError

    unickpt.save({"w": torch.ones(1), "trainer": {"x": 1}}, tmp_path / "c")
    m = tmp_path / "c" / "unickpt.json"
    obj = json.loads(m.read_bytes())
    text = None
    if case == "state null":
        obj["state"] = None
    elif case == "state a list":
        obj["state"] = []
    elif case == "state a float code":
        obj["state"] = {"__unickpt_float__": "inf"}
    else:  # nested deeper than any save writes, padded to pass the density bound, deeper than
        where = "state"  # the recursive readers go
        obj[where]["x"] = "@@"
        obj["extra"]["pad"] = " " * 20_000
        text = json.dumps(obj, separators=(",", ":")).replace('"@@"', "[" * 700 + "0" + "]" * 700)
    m.write_bytes(seal(obj) if text is None else seal_text(text))
    with pytest.raises(FormatError, match="must be objects|reserved|nested deeper"):
        unickpt.load({"w": torch.zeros(1), "trainer": {"x": 0}}, tmp_path / "c")


def test_keys_that_would_be_stored_under_one_name_are_refused(tmp_path):
    with pytest.raises(StateDictError, match="both stored as '1'"):
        unickpt.save({"t": {1: 5, "1": 6}}, tmp_path / "a")
    with pytest.raises(StateDictError, match="must be a str or int"):  # True would come back as "True"
        unickpt.save({"t": {True: 5}}, tmp_path / "b")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_saved_values_the_target_has_no_place_for_are_listed_as_skipped(tmp_path):
    unickpt.save({"model": {"w": torch.ones(2)}, "trainer": {"step": 5, "data_position": 123},
                  "optimizer": {"lr": 0.1}, "epoch": 4, "seed": 1}, tmp_path / "c")
    t = {"model": {"w": torch.zeros(2)}, "trainer": {"step": 0}, "epoch": 0}
    res = unickpt.load(t, tmp_path / "c")  # roles the target does not name are not its business
    assert t["trainer"] == {"step": 5} and t["epoch"] == 4
    assert sorted(res.skipped) == ["seed: saved, not in the target", "trainer.data_position: saved, not in the target"]
    res = unickpt.load({"model": {"w": torch.zeros(2)}}, tmp_path / "c")  # no top-level values of its own
    assert res.skipped == []

    class Loader:  # a stateful object gets what its state_dict() asks for; the rest is reported
        def __init__(self):
            self.s = {"epoch": 0}

        def state_dict(self):
            return dict(self.s)

        def load_state_dict(self, sd):
            self.s = dict(sd)

    a = Loader()
    a.s.update(epoch=3, resume_index=999)
    unickpt.save({"loader": a}, tmp_path / "s")
    b = Loader()
    res = unickpt.load({"loader": b}, tmp_path / "s")
    assert b.s == {"epoch": 3} and res.skipped == ["loader.resume_index: saved, not in the target"]


def test_missing_lists_only_what_the_load_leaves_as_it_was(tmp_path):
    unickpt.save({"t": {"x": 3}, "m": {"a": torch.ones(2)}}, tmp_path / "c")
    t = {"t": {"x": {"a": 0}}, "m": {"a": torch.zeros(2), "pair": [torch.zeros(2), 5], "tup": (torch.zeros(1), 6)}}
    res = unickpt.load(t, tmp_path / "c", strict=False)
    assert t["t"] == {"x": 3}  # the saved value replaces the target's whole
    assert sorted(res.missing) == ["m.pair.1", "m.tup.1", "m/pair.0", "m/tup.0"]


def test_a_target_that_ties_what_the_checkpoint_stores_apart_reports_the_second_name(tmp_path):
    unickpt.save({"model": {"emb": torch.ones(4), "head": torch.full((4,), 2.0)}}, tmp_path / "c")
    w = torch.zeros(4)
    res = unickpt.load({"model": {"emb": w, "head": w}}, tmp_path / "c")
    assert torch.equal(w, torch.ones(4))
    assert len(res.skipped) == 1 and res.skipped[0].startswith("model/head: the target ties it to model/emb")
    tied = torch.ones(4)  # tied when saved too: nothing to report
    unickpt.save({"model": {"emb": tied, "head": tied}}, tmp_path / "t")
    assert unickpt.load({"model": {"emb": w, "head": w}}, tmp_path / "t").skipped == []


def test_targets_that_cannot_hold_the_values_are_refused_before_reading(tmp_path):
    unickpt.save({"m": {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}}, tmp_path / "c")
    with pytest.raises(StateDictError, match="m/a is on the meta device"):
        unickpt.load({"m": {"a": torch.empty(4, device="meta"), "b": torch.zeros(4)}}, tmp_path / "c")
    with pytest.raises(StateDictError, match="m/a is an expanded view"):
        unickpt.load({"m": {"a": torch.zeros(1).expand(4), "b": torch.zeros(4)}}, tmp_path / "c")
    buf = torch.zeros(6)
    with pytest.raises(StateDictError, match="m/a and m/b share memory"):
        unickpt.load({"m": {"a": buf[0:4], "b": buf[2:6]}}, tmp_path / "c")
    assert torch.equal(buf, torch.zeros(6))
    cols = torch.zeros(4, 2)  # interleaved column views share no element: fine
    unickpt.save({"m": {"a": torch.ones(4), "b": torch.full((4,), 2.0)}}, tmp_path / "d")
    unickpt.load({"m": {"a": cols[:, 0], "b": cols[:, 1]}}, tmp_path / "d")
    assert torch.equal(cols, torch.tensor([[1.0, 2.0]] * 4))
    w = torch.zeros(4)  # one view under two roles (an fp32 model that is its own master): fine
    unickpt.save({"model": {"w": torch.ones(4)}, "master": {"w": torch.ones(4)}}, tmp_path / "e")
    unickpt.load({"model": {"w": w}, "master": {"w": w}}, tmp_path / "e")
    assert torch.equal(w, torch.ones(4))


def test_drop_warns_when_an_fp32_master_differs_from_its_model_weight(tmp_path):
    with pytest.warns(UserWarning, match=r"master='drop': 1 master tensor\(s\) are not equal"):
        unickpt.save({"model": {"w": torch.ones(8)}, "master": {"w": torch.full((8,), 2.0)}}, tmp_path / "a",
                     options=unickpt.SaveOptions(compression=unickpt.Compression(master="drop")))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal: exact, no warning
        unickpt.save({"model": {"w": torch.ones(8)}, "master": {"w": torch.ones(8)}}, tmp_path / "b",
                     options=unickpt.SaveOptions(compression=unickpt.Compression(master="drop")))


def test_inference_leaves_out_per_rank_values_of_the_model_role(tmp_path):
    unickpt.save({"model": {"w": torch.ones(4, 4), "seed": unickpt.per_rank(torch.tensor([7]))}}, tmp_path / "c")
    out = unickpt.load_for_inference(tmp_path / "c")
    assert sorted(out) == ["w"] and torch.equal(out["w"], torch.ones(4, 4))
    with pytest.raises(TensorMissingError, match="per-rank values"):
        unickpt.load_for_inference(tmp_path / "c", keys=["seed"])
