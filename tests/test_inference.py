"""Inference loader: model weights only, whole or TP-sliced, any dtype, no optimizer bytes."""

import os

import pytest
import torch

import unickpt
import unickpt.io.local as storage
from unickpt.errors import TensorMissingError
from unickpt.train.model import param_specs, LlamaConfig


@pytest.fixture
def ckpt(tmp_path):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(0)
    model = {n: torch.randn(s, generator=g).bfloat16() for n, s, _ in param_specs(cfg)}
    sd = {"model": model, "master": {n: t.float() for n, t in model.items()},
          "optimizer": {"exp_avg": {n: torch.zeros(t.shape) for n, t in model.items()}}}
    unickpt.save(sd, tmp_path / "step-00000010", step=10)
    return tmp_path, model


def test_whole_model_in_any_dtype_reading_only_model_files(ckpt, monkeypatch):
    root, model = ckpt
    opened = []
    real = storage.LocalStorage.open_reader
    monkeypatch.setattr(storage.LocalStorage, "open_reader", lambda self, p: (opened.append(os.path.basename(p)), real(self, p))[1])
    out = unickpt.load_for_inference(root, dtype=torch.float32)
    assert out.keys() == model.keys()
    for n, t in model.items():
        assert out[n].dtype == torch.float32 and torch.equal(out[n], t.float())
    assert opened and all(f.startswith("model-") for f in opened)


def test_tp_slices_follow_megatron_rules(ckpt):
    root, model = ckpt
    parts = [unickpt.load_for_inference(root, tp_rank=r, tp_size=2) for r in range(2)]
    q = "model.layers.1.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([p[q] for p in parts], 0), model[q])
    assert torch.equal(torch.cat([p[o] for p in parts], 1), model[o])
    assert torch.equal(parts[1]["lm_head.weight"], model["lm_head.weight"])  # replicated


def test_keys_filter_and_missing_keys(ckpt):
    root, model = ckpt
    out = unickpt.load_for_inference(root, keys=["model.layers.0.*", "lm_head.weight"])
    assert set(out) == {n for n in model if n.startswith("model.layers.0.")} | {"lm_head.weight"}
    with pytest.raises(TensorMissingError, match="nope"):
        unickpt.load_for_inference(root, keys=["nope"])


def _under_dist(rank, world, root):
    return float(unickpt.load_for_inference(root, tp_rank=rank, tp_size=world)["model.norm.weight"].sum())


def test_works_per_process_under_torch_distributed(ckpt):
    from tests import dist

    root, model = ckpt
    out = dist.run(_under_dist, 2, str(root))
    assert out[0] == out[1] == pytest.approx(float(model["model.norm.weight"].float().sum()), rel=1e-2)
