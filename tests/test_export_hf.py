"""Hugging Face interop: checkpoints and exported folders load with from_pretrained, and
their logits equal the trainer model's."""

import json
import os
import subprocess
import sys

import pytest
import torch

import unickpt
from tests.clirun import cli


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
    r = cli("export", path, dst, "--dtype", "bf16", "--max-shard-size", "40KiB", "-q")
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
    assert cli("export", path, dst, "-q").returncode == 0
    r = cli("export", path, dst, "-q")
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


# --- transformers models built from configs (no downloads): save, export, from_pretrained ---

def _tiny(kind, **kw):
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=128, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=128, **kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    return model.eval()


TOKENS = torch.arange(24).reshape(2, 12) * 5 % 128


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def _cast_params(model, dtype):
    """A copy of ``model`` with its parameters (not its buffers: the rotary frequencies stay
    fp32, as from_pretrained keeps them) in ``dtype``."""
    import copy

    model = copy.deepcopy(model)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def _save(model, path, **kw):
    from unickpt.hf import hf_extra_files

    unickpt.save({"model": model.state_dict()}, str(path), **({"extra_files": hf_extra_files(model)} | kw))
    return str(path)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_checkpoint_saved_with_hf_extra_files_loads_with_from_pretrained(kind, tmp_path):
    src = _tiny(kind)
    path = _save(src, tmp_path / "ck")
    model = _hf(path)
    assert model.dtype == torch.float32 and type(model) is type(src)
    assert torch.equal(_logits(model), _logits(src))
    assert sorted(os.listdir(path)) == sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                                               "unickpt.json", "model-00001-of-00001.safetensors"])


def test_hf_extra_files_is_what_save_pretrained_writes(tmp_path):
    from unickpt.hf import hf_extra_files, is_hf_config, is_hf_model

    model = _tiny("qwen2").to(torch.bfloat16)
    model.config.dtype = "float32"  # stale: save_pretrained records the model's dtype, so must we
    files = hf_extra_files(model)
    assert model.config.dtype == "float32"  # the model's own config is left alone
    model.save_pretrained(tmp_path)
    assert sorted(files) == ["config.json", "generation_config.json"]
    for name, text in files.items():
        assert text == (tmp_path / name).read_text(), name
    assert json.loads(files["config.json"])["dtype"] == "bfloat16"
    assert list(hf_extra_files(model.config)) == ["config.json"]
    assert is_hf_model(model) and not is_hf_model(model.config) and not is_hf_model(torch.nn.Linear(2, 2))
    assert is_hf_config(model.config) and not is_hf_config({"model_type": "qwen2"})
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="PreTrainedModel or PretrainedConfig"):
        hf_extra_files({"model_type": "qwen2"})


def test_is_hf_model_does_not_import_transformers():
    code = ("import sys, torch, unickpt.hf as h; assert not h.is_hf_model(torch.nn.Linear(2, 2)); "
            "assert not h.is_hf_config({}); assert 'transformers' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_loads_in_the_requested_dtype_with_the_source_logits(kind, dtype, tmp_path):
    from unickpt.export import export_hf

    src = _tiny(kind)
    path = _save(src, tmp_path / "ck")
    export_hf(path, tmp_path / "hf", dtype=dtype)
    conf = json.load(open(tmp_path / "hf" / "config.json"))
    name = str(dtype).split(".")[1]
    assert conf["dtype"] == conf["torch_dtype"] == name
    model = _hf(str(tmp_path / "hf"))  # no dtype argument: the config says it
    assert {p.dtype for p in model.parameters()} == {dtype}
    ref = _cast_params(src, dtype)  # the source model in the requested dtype
    assert torch.equal(_logits(model), _logits(ref))
    if dtype == torch.bfloat16:  # and within bf16 rounding of the fp32 source
        assert torch.allclose(_logits(model).float(), _logits(src), atol=0.05, rtol=0.05)
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == (tmp_path / "ck" / "generation_config.json").read_bytes()


def test_export_sets_the_dtype_of_sub_configs(tmp_path):
    from unickpt.export import export_hf

    src = _tiny("llama")
    conf = json.loads(src.config.to_json_string())
    conf["dtype"] = conf["torch_dtype"] = "float16"
    conf["text_config"] = {"model_type": "llama", "dtype": "float16"}  # a composite model's sub-config
    conf["quantization_config"] = {"quant_method": "none"}  # not a model config: left alone
    path = _save(src, tmp_path / "ck", extra_files={"config.json": json.dumps(conf)})
    export_hf(path, tmp_path / "hf", dtype=torch.bfloat16)
    out = json.load(open(tmp_path / "hf" / "config.json"))
    assert out["dtype"] == out["torch_dtype"] == "bfloat16"
    assert out["text_config"] == {"model_type": "llama", "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert out["quantization_config"] == {"quant_method": "none"}
    export_hf(path, tmp_path / "same")  # no cast: the config names the stored dtype (as save_pretrained does)
    assert json.load(open(tmp_path / "same" / "config.json"))["dtype"] == "float32"


def test_export_with_config_for_a_checkpoint_without_one(tmp_path):
    from unickpt.export import export_hf
    from unickpt.hf import hf_extra_files

    src = _tiny("llama")
    path = str(tmp_path / "ck")
    unickpt.save({"model": src.state_dict(), "optimizer": {"step": torch.zeros(())}}, path)
    export_hf(path, tmp_path / "bare")
    assert "config.json" not in os.listdir(tmp_path / "bare")
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "config.json").write_text(hf_extra_files(src)["config.json"])
    for i, config in enumerate([tmp_path / "given" / "config.json", str(tmp_path / "given"),
                                json.loads(src.config.to_json_string()), src.config]):
        dst = tmp_path / f"hf{i}"
        export_hf(path, dst, config=config, dtype=torch.bfloat16)
        model = _hf(str(dst))
        assert model.dtype == torch.bfloat16, config
        assert torch.equal(_logits(model), _logits(_cast_params(src, torch.bfloat16)))
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="cannot read"):
        export_hf(path, tmp_path / "x", config=tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(unickpt.errors.FormatError, match="bad.json: must hold a JSON object"):
        export_hf(path, tmp_path / "x", config=tmp_path / "bad.json")
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="config must be"):
        export_hf(path, tmp_path / "x", config=3)
    assert not (tmp_path / "x").exists()


def _index(folder):
    return json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]


def test_export_writes_tied_weights_once_like_save_pretrained(tmp_path):
    from unickpt.export import export_hf

    src = _tiny("gpt2")
    assert src.lm_head.weight is src.transformer.wte.weight
    src.save_pretrained(tmp_path / "sp")
    path = _save(src, tmp_path / "ck")
    assert unickpt.read_manifest(path)[1].aliases == {("model", "lm_head.weight"): "transformer.wte.weight"}
    export_hf(path, tmp_path / "hf")
    names = set(_index(tmp_path / "hf"))
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    from safetensors import safe_open

    with safe_open(str(tmp_path / "sp" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # the names save_pretrained writes
    model = _hf(str(tmp_path / "hf"))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(_logits(model), _logits(src))


def test_export_keeps_both_names_when_the_config_does_not_tie(tmp_path):
    from unickpt.export import export_hf

    src = _tiny("gpt2", tie_word_embeddings=False)
    assert src.lm_head.weight is not src.transformer.wte.weight
    path = _save(src, tmp_path / "ck")
    export_hf(path, tmp_path / "hf", dtype=torch.bfloat16)
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(_index(tmp_path / "hf"))
    model = _hf(str(tmp_path / "hf"))
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(_logits(model), _logits(_cast_params(src, torch.bfloat16)))


def test_export_keeps_a_tied_pair_whose_values_differ(tmp_path):
    from unickpt.export import export_hf

    src = _tiny("gpt2")
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    sd["lm_head.weight"] += 1  # the config ties them, the checkpoint does not: transformers keeps both
    from unickpt.hf import hf_extra_files

    unickpt.save({"model": sd}, str(tmp_path / "ck"), extra_files=hf_extra_files(src))
    export_hf(tmp_path / "ck", tmp_path / "hf")
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(_index(tmp_path / "hf"))


def test_export_writes_the_kept_name_when_the_checkpoint_stores_the_other(tmp_path):
    from unickpt.export import export_hf
    from unickpt.hf import hf_extra_files

    src = _tiny("gpt2")
    sd = src.state_dict()
    sd = {"lm_head.weight": sd.pop("lm_head.weight"), **sd}  # stored under lm_head, wte an alias of it
    unickpt.save({"model": sd}, str(tmp_path / "ck"), extra_files=hf_extra_files(src))
    assert unickpt.read_manifest(tmp_path / "ck")[1].aliases == {("model", "transformer.wte.weight"): "lm_head.weight"}
    model = _hf(str(tmp_path / "ck"))  # the checkpoint itself (index: lm_head only): transformers ties either way
    assert model.lm_head.weight is model.transformer.wte.weight and torch.equal(_logits(model), _logits(src))
    export_hf(tmp_path / "ck", tmp_path / "hf", dtype=torch.bfloat16)
    names = set(_index(tmp_path / "hf"))
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    model = _hf(str(tmp_path / "hf"))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(_logits(model), _logits(_cast_params(src, torch.bfloat16)))


def test_export_writes_every_name_of_aliases_the_config_does_not_tie(tmp_path):
    from unickpt.export import export_hf

    src = _tiny("gpt2")  # tied in memory: the manifest records the alias
    conf = json.loads(src.config.to_json_string())
    conf["tie_word_embeddings"] = False
    unickpt.save({"model": src.state_dict()}, str(tmp_path / "ck"), extra_files={"config.json": json.dumps(conf)})
    assert unickpt.read_manifest(tmp_path / "ck")[1].aliases
    export_hf(tmp_path / "ck", tmp_path / "hf")
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(_index(tmp_path / "hf"))
    model = _hf(str(tmp_path / "hf"))
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, src.lm_head.weight)
    assert torch.equal(_logits(model), _logits(src))
    unickpt.save({"model": src.state_dict()}, str(tmp_path / "bare"))  # nothing ties without a config either
    export_hf(tmp_path / "bare", tmp_path / "noconf")
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(_index(tmp_path / "noconf"))


def test_export_without_transformers_writes_tied_weights_under_both_names(tmp_path):
    src = _tiny("gpt2")
    path = _save(src, tmp_path / "ck")
    code = ("import sys; sys.modules['transformers'] = None\n"  # import transformers fails
            "from unickpt.export import export_hf; export_hf(sys.argv[1], sys.argv[2])")
    r = subprocess.run([sys.executable, "-c", code, path, str(tmp_path / "hf")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(_index(tmp_path / "hf"))
    model = _hf(str(tmp_path / "hf"))  # equal copies: transformers ties them on load
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(_logits(model), _logits(src))


def test_export_expands_tied_weight_patterns_like_transformers(tmp_path, monkeypatch):
    import transformers

    from unickpt.export import export_hf

    src = _tiny("gpt2")
    path = _save(src, tmp_path / "ck")
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "_tied_weights_keys", {r"lm_head\.weight": r"transformer\.wte\.weight"})
    export_hf(path, tmp_path / "hf")
    names = set(_index(tmp_path / "hf"))
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_save_with_hf_config_or_a_model_value_loads_with_from_pretrained_and_back(kind, tmp_path):
    src = _tiny(kind)
    unickpt.save({"model": src}, str(tmp_path / "module"))  # a transformers model: its files come along
    unickpt.save({"model": src.state_dict()}, str(tmp_path / "config"), hf_config=src.config)
    for path in (tmp_path / "module", tmp_path / "config"):
        assert "config.json" in os.listdir(path)
        model = _hf(str(path))
        assert torch.equal(_logits(model), _logits(src))
        fresh = _tiny(kind)
        torch.nn.init.zeros_(fresh.get_input_embeddings().weight)
        unickpt.load({"model": fresh}, str(path))  # resume: back into a module
        assert torch.equal(_logits(fresh), _logits(src))
        if kind == "gpt2":
            assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_export_casts_floating_point_weights_only(tmp_path):
    from safetensors import safe_open

    from unickpt.export import export_hf

    sd = {"w": torch.randn(4, 4), "ids": torch.arange(6), "mask": torch.ones(3, dtype=torch.bool)}
    unickpt.save({"model": sd}, str(tmp_path / "ck"))
    export_hf(tmp_path / "ck", tmp_path / "hf", dtype=torch.float16, config={"model_type": "llama"})
    with safe_open(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert got["w"].dtype == torch.float16 and torch.equal(got["w"], sd["w"].half())
    assert torch.equal(got["ids"], sd["ids"]) and torch.equal(got["mask"], sd["mask"])
    assert json.load(open(tmp_path / "hf" / "config.json")) == {"model_type": "llama", "dtype": "float16",
                                                                 "torch_dtype": "float16"}
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="export dtype"):
        export_hf(tmp_path / "ck", tmp_path / "x", dtype=torch.int8)


def test_export_refuses_side_files_the_checkpoint_does_not_vouch_for(tmp_path):
    from unickpt.export import export_hf

    src = _tiny("llama")
    path = _save(src, tmp_path / "ck")
    gen = tmp_path / "ck" / "generation_config.json"
    gen.write_text(gen.read_text().replace("}", ', "do_sample": true}'))
    with pytest.raises(unickpt.errors.ChecksumError, match="generation_config.json: does not match"):
        export_hf(path, tmp_path / "hf")
    path = str(tmp_path / "bare")
    unickpt.save({"model": src.state_dict()}, path, extra_files={"config.json": src.config.to_json_string()})
    (tmp_path / "bare" / "generation_config.json").write_text("{}")
    with pytest.raises(unickpt.errors.FormatError, match="generation_config.json: not part of the checkpoint"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
