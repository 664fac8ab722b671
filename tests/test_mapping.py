"""Mappings in the load plan (issue #41 item 1): a serving rank's fused tensors (``qkv_proj``,
``gate_up_proj``, row- and vocab-parallel splits) and stacked experts read straight from a
training checkpoint of ``transformers`` models built from configs, equal to slicing the
trainer's tensors by hand; every mapping that cannot be honoured refused before a byte is
written."""

import os

import pytest
import torch

import unickpt
from tests import dist
from unickpt.errors import ChecksumError, MappingError, TensorMissingError

HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)


def _model(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    torch.manual_seed(0)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "mixtral": MixtralConfig}[kind]
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if kind == "mixtral" else {}
    config = cfg(**HF, **extra)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # (biases are zero at init: make them tell rows apart)
        for p in model.parameters():
            p.normal_()
    return model, config


def _tp(x: torch.Tensor, dim: int, units: int, r: int, n: int) -> torch.Tensor:
    """TP rank r's block of x along dim, in whole units (heads); fewer units than ranks:
    one unit shared by n // units ranks."""
    per = x.shape[dim] // units
    if units % n == 0:
        k = units // n
        return x.narrow(dim, r * k * per, k * per)
    return x.narrow(dim, (r // (n // units)) * per, per)


def _fused_expected(sd: dict, config, r: int, n: int) -> dict:
    """What a vLLM-style engine's TP rank r holds, sliced from the trainer's tensors by hand."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    out = {}
    for k, v in sd.items():
        if ".self_attn.q_proj." in k:
            base, kind = k.split(".self_attn.q_proj.")
            parts = [_tp(sd[f"{base}.self_attn.{x}_proj.{kind}"], 0, u, r, n) for x, u in (("q", heads), ("k", kv), ("v", kv))]
            out[f"{base}.self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        elif ".mlp.gate_proj." in k:
            base, kind = k.split(".mlp.gate_proj.")
            out[f"{base}.mlp.gate_up_proj.{kind}"] = torch.cat(
                [_tp(sd[f"{base}.mlp.{x}_proj.{kind}"], 0, n, r, n) for x in ("gate", "up")])
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            out[k] = _tp(v, 1, n, r, n)
        elif k.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[k] = _tp(v, 0, n, r, n)
        elif not any(s in k for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[k] = v
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapping")
    out = {}
    for kind in ("llama", "qwen2", "mistral"):
        model, config = _model(kind)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        unickpt.save({"model": sd}, str(root / kind))
        out[kind] = (str(root / kind), sd, config)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_serving_rank_reads_its_fused_tp_shard_without_a_converter(saved, kind, tp):
    path, sd, config = saved[kind]
    for r in range(tp):
        want = _fused_expected(sd, config, r, tp)
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        res = unickpt.load({"model": target}, path, options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.fused(config, tp_rank=r, tp_size=tp)))
        assert res.verified > 0
        for k, v in want.items():
            assert torch.equal(target[k], v), (kind, tp, r, k)


def test_the_fused_weights_give_the_trainers_logits(saved):
    """TP 1: the fused tensors split back into a fresh model give the trained model's logits
    bit for bit (the fused layout holds exactly the trainer's values, in the engine's order)."""
    from transformers import AutoModelForCausalLM

    path, sd, config = saved["qwen2"]
    want = _fused_expected(sd, config, 0, 1)
    fused = {k: torch.zeros_like(v) for k, v in want.items()}
    unickpt.load({"model": fused}, path, options=unickpt.LoadOptions(mapping=unickpt.Mapping.fused(config)))
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    back = {}
    for k, v in fused.items():
        if ".qkv_proj." in k:
            base, kind = k.split(".self_attn.qkv_proj.")
            for x, part in zip("qkv", torch.split(v, [q, kv, kv])):
                back[f"{base}.self_attn.{x}_proj.{kind}"] = part
        elif ".gate_up_proj." in k:
            base, kind = k.split(".mlp.gate_up_proj.")
            for x, part in zip(("gate", "up"), v.chunk(2)):
                back[f"{base}.mlp.{x}_proj.{kind}"] = part
        else:
            back[k] = v
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.load_state_dict(back)
    ref = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ref.load_state_dict(sd)
    ids = torch.arange(10).view(1, -1)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def _hub_moe(sd: dict) -> dict:
    """The Hub's Mixtral files from transformers 5's stacked experts: per-expert w1 (gate), w3
    (up), w2 (down) and block_sparse_moe.gate."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            base = k[: -len(".mlp.experts.gate_up_proj")]
            for e in range(v.shape[0]):
                w1, w3 = v[e].chunk(2)
                out[f"{base}.block_sparse_moe.experts.{e}.w1.weight"] = w1.clone()
                out[f"{base}.block_sparse_moe.experts.{e}.w3.weight"] = w3.clone()
        elif k.endswith(".mlp.experts.down_proj"):
            base = k[: -len(".mlp.experts.down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}.block_sparse_moe.experts.{e}.w2.weight"] = v[e].clone()
        elif k.endswith(".mlp.gate.weight"):
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v.clone()
        else:
            out[k] = v.clone()
    return out


def test_stacked_experts_from_the_hubs_per_expert_keys_give_the_models_logits(tmp_path):
    """A Mixtral checkpoint in the Hub's per-expert keys loads into transformers 5's stacked
    experts (gate and up side by side per expert) by mapping: the model's logits, bit for bit;
    an expert-parallel rank's box of the stack reads only its experts."""
    from transformers import AutoModelForCausalLM

    model, config = _model("mixtral")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    unickpt.save({"model": _hub_moe(sd)}, str(tmp_path / "moe"))
    m = unickpt.Mapping.mixtral_experts()
    fresh = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    unickpt.load({"model": fresh}, str(tmp_path / "moe"), options=unickpt.LoadOptions(mapping=m))
    for k, v in sd.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    ids = torch.arange(12).view(1, -1)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    # expert parallelism: experts 2 and 3 of a layer's stack (a box of the global tensor)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    local = torch.zeros(2, *sd[name].shape[1:], dtype=torch.bfloat16)
    res = unickpt.load({"model": {name: unickpt.shard(local, tuple(sd[name].shape), offsets=(2, 0, 0))}},
                       str(tmp_path / "moe"), options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(local, sd[name][2:]) and res.tensors == 4  # w1 and w3 of experts 2 and 3
    generic = unickpt.Mapping.stacked_experts(r"(.*)\.mlp\.experts\.down_proj", r"\1.block_sparse_moe.experts.{e}.w2.weight")
    down = torch.zeros_like(sd["model.layers.0.mlp.experts.down_proj"])
    unickpt.load({"model": {"model.layers.0.mlp.experts.down_proj": down}}, str(tmp_path / "moe"),
                 options=unickpt.LoadOptions(mapping=generic))
    assert torch.equal(down, sd["model.layers.0.mlp.experts.down_proj"])


def test_renames_read_other_names_and_compose(saved):
    path, sd, _ = saved["llama"]
    m = unickpt.Mapping.rename({r"tok\.(.*)": r"model.embed_tokens.\1"}) + unickpt.Mapping.rename(
        [(r"out", "lm_head.weight")])
    target = {"tok.weight": torch.zeros_like(sd["model.embed_tokens.weight"]), "out": torch.zeros_like(sd["lm_head.weight"])}
    unickpt.load({"model": target}, path, options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(target["tok.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(target["out"], sd["lm_head.weight"])


def test_mappings_that_cannot_be_honoured_are_refused_before_any_byte_is_written(saved, tmp_path):
    path, sd, config = saved["llama"]
    with pytest.raises(MappingError, match="does not divide its 4 heads"):
        unickpt.Mapping.fused(config, tp_rank=0, tp_size=3)
    with pytest.raises(MappingError, match="tp_rank"):
        unickpt.Mapping.fused(config, tp_rank=2, tp_size=2)
    with pytest.raises(MappingError, match="heads"):
        unickpt.Mapping.fused(None)
    want = _fused_expected(sd, config, 0, 2)
    # a target of the wrong size (the TP=1 shape on a TP=2 mapping): nothing written
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    target[qkv] = torch.zeros(want[qkv].shape[0] * 2, want[qkv].shape[1], dtype=torch.bfloat16)
    with pytest.raises(MappingError, match="qkv_proj"):
        unickpt.load({"model": target}, path, options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.fused(config, tp_rank=0, tp_size=2)))
    assert all(not t.any() for t in target.values())
    # a source the checkpoint does not hold: named, nothing written
    part = {k: v.clone() for k, v in sd.items() if ".v_proj." not in k}
    unickpt.save({"model": part}, str(tmp_path / "partial"))
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    with pytest.raises(TensorMissingError, match="v_proj"):
        unickpt.load({"model": target}, str(tmp_path / "partial"), options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.fused(config, tp_rank=0, tp_size=2)))
    assert all(not t.any() for t in target.values())
    with pytest.raises(unickpt.errors.InvalidArgumentError, match="Mapping"):
        unickpt.LoadOptions(mapping={"a": "b"})


def test_a_damaged_byte_inside_a_mapped_piece_is_caught(saved, tmp_path):
    import shutil

    path, sd, config = saved["llama"]
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    _, man = unickpt.read_manifest(dst)
    t = man.tensors[("model", "model.layers.1.self_attn.k_proj.weight")]
    fe = man.files[t.file]
    with open(dst / t.file, "r+b") as f:  # a byte of k_proj's first rows (TP rank 0's share)
        f.seek(fe.data_start + t.begin + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    want = _fused_expected(sd, config, 0, 2)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    with pytest.raises(ChecksumError, match="k_proj"):
        unickpt.load({"model": target}, str(dst), options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.fused(config, tp_rank=0, tp_size=2)))


def _serve(rank, world, path):
    """An inference job of its own: TP ranks, each loading its fused shard (collective load)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**HF)
    _, man = unickpt.read_manifest(path)
    shapes = {n: t.shape for (r, n), t in man.tensors.items() if r == "model"}
    full = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    unickpt.load({"model": full}, path, group="local")
    want = _fused_expected(full, config, rank, world)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    unickpt.load({"model": target}, path, options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.fused(config, tp_rank=rank, tp_size=world)))
    return all(torch.equal(target[k], v) for k, v in want.items())


def test_an_inference_job_of_two_tp_ranks_loads_its_shards_collectively(saved):
    path, _, _ = saved["llama"]
    assert dist.run(_serve, 2, path) == [True, True]
    assert os.path.isdir(path)


def _meta(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's (and torchtitan's) rotary row order of a Hugging Face q/k weight: the inverse of
    the permutation Hugging Face's conversion script applies."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _titan(sd: dict, config) -> dict:
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention.wq.weight"] = _meta(sd[p + "self_attn.q_proj.weight"], config.num_attention_heads)
        out[f"layers.{i}.attention.wk.weight"] = _meta(sd[p + "self_attn.k_proj.weight"], config.num_key_value_heads)
        out[f"layers.{i}.attention.wv.weight"] = sd[p + "self_attn.v_proj.weight"]
        out[f"layers.{i}.attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        for t, h in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            out[f"layers.{i}.feed_forward.{t}.weight"] = sd[p + f"mlp.{h}_proj.weight"]
        out[f"layers.{i}.attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return {k: v.clone() for k, v in out.items()}


def test_torchtitan_and_hugging_face_llama_names_both_ways_with_the_rotary_rows(saved, tmp_path):
    """A torchtitan checkpoint loads into a transformers Llama (q/k rows permuted between the
    rotary layouts, as Hugging Face's conversion script does): the model's logits bit for bit;
    a Hugging Face checkpoint loads into torchtitan's names and layout; the two mappings are
    each other's inverse."""
    from transformers import AutoModelForCausalLM

    path, sd, config = saved["llama"]
    titan = _titan(sd, config)
    unickpt.save({"model": titan}, str(tmp_path / "titan"))
    fresh = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    unickpt.load({"model": fresh}, str(tmp_path / "titan"), options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.hf_from_torchtitan(config)))
    ref = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ref.load_state_dict(sd)
    ids = torch.arange(9).view(1, -1)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, ref(ids).logits)
    target = {k: torch.zeros_like(v) for k, v in titan.items()}
    unickpt.load({"model": target}, path, options=unickpt.LoadOptions(mapping=unickpt.Mapping.torchtitan_from_hf(config)))
    for k, v in titan.items():
        assert torch.equal(target[k], v), k
    # row shards (FSDP, TP) and column blocks of the permuted weights, both ways, rows cut mid-head
    for (offsets, sizes) in (((0, 0), (16, 32)), ((16, 0), (16, 32)), ((5, 0), (11, 32)), ((3, 7), (20, 9))):
        box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        part = torch.full(sizes, float("nan"), dtype=torch.bfloat16)
        unickpt.load({"model": {"layers.0.attention.wq.weight": unickpt.shard(part, (32, 32), offsets=offsets)}}, path,
                     options=unickpt.LoadOptions(mapping=unickpt.Mapping.torchtitan_from_hf(config)))
        assert torch.equal(part, titan["layers.0.attention.wq.weight"][box]), offsets
        part = torch.full(sizes, float("nan"), dtype=torch.bfloat16)
        unickpt.load({"model": {"model.layers.0.self_attn.q_proj.weight": unickpt.shard(part, (32, 32), offsets=offsets)}},
                     str(tmp_path / "titan"), options=unickpt.LoadOptions(mapping=unickpt.Mapping.hf_from_torchtitan(config)))
        assert torch.equal(part, sd["model.layers.0.self_attn.q_proj.weight"][box]), offsets


def test_a_rule_whose_pieces_overlap_or_leave_a_gap_is_refused(saved):
    """A user's own rule: pieces that cover the target's element count but overlap (so some
    element is never written) are refused, as are pieces outside the source."""
    from unickpt.mapping import Piece, Rule

    path, sd, _ = saved["llama"]

    class Overlapping(Rule):
        def __init__(self, rows_b):
            self.rows_b = rows_b

        def match(self, name):
            return name == "w"

        def pieces(self, name, shape, source_shape):
            half = shape[0] // 2
            return [Piece((0, 0), (half, shape[1]), "model.embed_tokens.weight", (0, 0)),
                    Piece((self.rows_b, 0), (half, shape[1]), "model.embed_tokens.weight", (0, 0))]

    target = torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(MappingError, match="overlap"):
        unickpt.load({"model": {"w": target}}, path, options=unickpt.LoadOptions(mapping=unickpt.Mapping([Overlapping(2)])))
    assert not target.any()
    unickpt.load({"model": {"w": target}}, path, options=unickpt.LoadOptions(mapping=unickpt.Mapping([Overlapping(4)])))
    assert torch.equal(target[4:], sd["model.embed_tokens.weight"][:4])

    class Outside(Overlapping):
        def pieces(self, name, shape, source_shape):
            return [Piece((0, 0), tuple(shape), "model.embed_tokens.weight", (62, 0))]

    with pytest.raises(MappingError, match="outside its shape"):
        unickpt.load({"model": {"w": target}}, path, options=unickpt.LoadOptions(mapping=unickpt.Mapping([Outside(0)])))


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _attention(draw):
    """A random attention shape: heads, KV heads dividing them, head dim (even), columns, and
    a TP degree that divides the heads and divides or is divided by the KV heads."""
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    tp = draw(st.sampled_from([n for n in (1, 2, 3, 4, 6, 8) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]))
    return heads, kv, 2 * draw(st.integers(1, 3)), draw(st.integers(1, 5)), tp


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=_attention(), seed=st.integers(0, 2**16))
def test_property_fused_shards_and_rotary_round_trips_over_random_shapes(tmp_path_factory, shape, seed):
    """Over random head counts, head dims, widths and TP degrees: each TP rank's fused q/k/v
    rows equal slicing by hand; the TP ranks' shards, put back by hand, are the stored
    tensors (serving -> training); and torchtitan_from_hf after hf_from_torchtitan is the
    identity (the rotary permutations are each other's inverse)."""
    heads, kv, hd, cols, tp = shape
    g = torch.Generator().manual_seed(seed)
    sd = {f"model.layers.0.self_attn.{x}_proj.weight": torch.randn(n * hd, cols, generator=g)
          for x, n in (("q", heads), ("k", kv), ("v", kv))}
    root = tmp_path_factory.mktemp("prop")
    unickpt.save({"model": sd}, str(root / "hf"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    qs, ks, vs = [], [], []
    for r in range(tp):
        rows = (heads // tp + 2 * max(1, kv // tp)) * hd
        target = torch.full((rows, cols), float("nan"))
        unickpt.load({"model": {name: target}}, str(root / "hf"), options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.fused(num_heads=heads, num_kv_heads=kv, tp_rank=r, tp_size=tp)))
        q, k, v = torch.split(target, [heads // tp * hd, max(1, kv // tp) * hd, max(1, kv // tp) * hd])
        assert torch.equal(q, _tp(sd["model.layers.0.self_attn.q_proj.weight"], 0, heads, r, tp))
        assert torch.equal(k, _tp(sd["model.layers.0.self_attn.k_proj.weight"], 0, kv, r, tp))
        qs.append(q)
        if kv % tp == 0 or r % (tp // kv) == 0:  # (replicated KV heads: one copy of each)
            ks.append(k)
            vs.append(v)
    assert torch.equal(torch.cat(qs), sd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(torch.cat(ks), sd["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(torch.cat(vs), sd["model.layers.0.self_attn.v_proj.weight"])
    # rotary: HF -> torchtitan (a checkpoint of its own) -> HF is the identity
    titan = {"layers.0.attention.wq.weight": torch.zeros(heads * hd, cols),
             "layers.0.attention.wk.weight": torch.zeros(kv * hd, cols)}
    unickpt.load({"model": titan}, str(root / "hf"), options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.torchtitan_from_hf(num_heads=heads, num_kv_heads=kv)))
    assert torch.equal(titan["layers.0.attention.wq.weight"], _meta(sd["model.layers.0.self_attn.q_proj.weight"], heads))
    unickpt.save({"model": titan}, str(root / "titan"))
    back = {k: torch.zeros_like(v) for k, v in sd.items() if ".v_proj." not in k}
    unickpt.load({"model": back}, str(root / "titan"), options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.hf_from_torchtitan(num_heads=heads, num_kv_heads=kv)))
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k
    # a box of the permuted rows (an FSDP or TP row shard, cut anywhere; a column block), both ways
    rows = heads * hd
    r0 = seed % rows
    r1 = r0 + 1 + (seed // 7) % (rows - r0)
    c0 = (seed // 3) % cols
    c1 = c0 + 1 + (seed // 11) % (cols - c0)
    for name, path, m, want in (
            ("layers.0.attention.wq.weight", root / "hf", unickpt.Mapping.torchtitan_from_hf(num_heads=heads),
             _meta(sd["model.layers.0.self_attn.q_proj.weight"], heads)),
            ("model.layers.0.self_attn.q_proj.weight", root / "titan", unickpt.Mapping.hf_from_torchtitan(num_heads=heads),
             sd["model.layers.0.self_attn.q_proj.weight"])):
        part = torch.full((r1 - r0, c1 - c0), float("nan"))
        unickpt.load({"model": {name: unickpt.shard(part, (rows, cols), offsets=(r0, c0))}}, str(path),
                     options=unickpt.LoadOptions(mapping=m))
        assert torch.equal(part, want[r0:r1, c0:c1]), (name, r0, r1, c0, c1)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(e=st.integers(1, 5), rows=st.integers(1, 4), cols=st.integers(1, 4), two=st.booleans(), data=st.data())
def test_property_stacked_experts_over_random_shapes_and_expert_parallel_boxes(tmp_path_factory, e, rows, cols, two,
                                                                                data):
    """Per-expert keys (one or two per expert, side by side) into an [E, ...] stack, whole and
    as a random box of experts (expert parallelism): equal to stacking by hand."""
    g = torch.Generator().manual_seed(e * 100 + rows * 10 + cols)
    sd = {f"l.experts.{i}.{w}": torch.randn(rows, cols, generator=g) for i in range(e) for w in (("a", "b") if two else ("a",))}
    root = tmp_path_factory.mktemp("moe")
    unickpt.save({"model": sd}, str(root / "c"))
    srcs = (r"l.experts.{e}.a", r"l.experts.{e}.b") if two else (r"l.experts.{e}.a",)
    m = unickpt.Mapping.stacked_experts(r"stack", *srcs)
    full = torch.stack([torch.cat([sd[s.replace("{e}", str(i))] for s in srcs]) for i in range(e)])
    target = torch.zeros_like(full)
    unickpt.load({"model": {"stack": target}}, str(root / "c"), options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(target, full)
    a = data.draw(st.integers(0, e - 1))
    b = data.draw(st.integers(a + 1, e))
    local = torch.zeros(b - a, *full.shape[1:])
    unickpt.load({"model": {"stack": unickpt.shard(local, tuple(full.shape), offsets=(a, 0, 0))}}, str(root / "c"),
                 options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(local, full[a:b])
