"""Hugging Face interop: checkpoints and exported folders load with from_pretrained, and
their logits equal the trainer model's."""

import json
import os
import subprocess
import sys

import pytest
import torch

import unickpt


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from unickpt.train import LlamaConfig, TextData, Trainer, UnifiedCheckpoint

    root = str(tmp_path_factory.mktemp("hf"))
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    t = Trainer(cfg, TextData(seq_len=16, max_bytes=1 << 18), checkpoint=UnifiedCheckpoint(dir=root), global_batch=4, micro_batch=4)
    t.fit(3)
    t.save()
    tokens = t.data.eval_windows[:2, :16]
    with torch.no_grad():
        logits = t._logits(tokens)
    return os.path.join(root, "step-00000003"), tokens, logits


def _hf(path, **kw):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def test_checkpoint_directory_loads_with_from_pretrained(trained):
    path, tokens, logits = trained
    with torch.no_grad():
        assert torch.equal(_hf(path)(tokens).logits, logits)


def test_export_bf16_in_shards_loads_and_matches(trained, tmp_path):
    path, tokens, logits = trained
    dst = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "unickpt.cli", "export", path, str(dst), "--dtype", "bf16",
                        "--max-shard-size", "40KiB", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    files = sorted(os.listdir(dst))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "config.json" in files and "model.safetensors.index.json" in files
    assert json.load(open(dst / "config.json"))["torch_dtype"] == "bfloat16"
    want = unickpt.load_for_inference(path, dtype=torch.bfloat16)
    model = _hf(str(dst), dtype=torch.bfloat16)
    for n, p in model.state_dict().items():
        assert torch.equal(p, want[n]), n
    with torch.no_grad():
        ref = _hf(path, dtype=torch.bfloat16)(tokens).logits  # same loading path: HF casts on load
        assert torch.equal(model(tokens).logits, ref)


def test_export_refuses_existing_dst_and_bad_sources(trained, tmp_path):
    path, _, _ = trained
    dst = tmp_path / "out"
    assert subprocess.run([sys.executable, "-m", "unickpt.cli", "export", path, str(dst), "-q"]).returncode == 0
    r = subprocess.run([sys.executable, "-m", "unickpt.cli", "export", path, str(dst), "-q"], capture_output=True, text=True)
    assert r.returncode == 2 and "CheckpointExistsError" in r.stderr
    before = sorted(os.listdir(dst))
    # a corrupted source: clear error, the existing destination untouched, nothing else written
    from unickpt.export import export_hf

    ckpt, man = unickpt.read_manifest(path)
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(ckpt, bad)
    t = man.tensors[("model", "lm_head.weight")]
    with open(bad / t.file, "r+b") as f:
        f.seek(man.files[t.file].data_start + t.begin + 3)
        f.write(b"\x55\x55")
    with pytest.raises(unickpt.errors.ChecksumError, match="lm_head.weight"):
        export_hf(bad, dst, overwrite=True)
    assert sorted(os.listdir(dst)) == before
    assert sorted(os.listdir(tmp_path)) == ["bad", "out"]
    with pytest.raises(unickpt.errors.CheckpointNotFoundError):
        export_hf(tmp_path / "nothing", tmp_path / "x")
    assert not (tmp_path / "x").exists()
