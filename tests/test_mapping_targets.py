"""Mappings where the load lists its own targets (issue #41 item 1): ``Mapping.targets``
enumerates what a mapping makes from a checkpoint's names, so ``load_for_inference``,
``export_hf`` (and ``unickpt export --from-torchtitan``) and the DCP reader take a mapping;
each read verified, only the boxes each target needs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import unickpt
from tests import dist
from tests.test_mapping import _fused_expected, _hub_moe, _model, _titan
from unickpt.errors import InvalidArgumentError, MappingError, TensorMissingError
from unickpt.export import export_hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    model, config = _model("llama")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    unickpt.save({"model": sd}, str(root / "hf"), extra_files={"config.json": config.to_json_string()})
    titan = _titan(sd, config)
    unickpt.save({"model": titan}, str(root / "titan"))
    return root, sd, titan, config


def test_targets_lists_what_each_built_in_makes_and_passes_the_rest_through(llama):
    _, sd, titan, config = llama
    stored = {k: tuple(v.shape) for k, v in sd.items()}
    for r in range(2):
        want = _fused_expected(sd, config, r, 2)
        assert unickpt.Mapping.fused(config, tp_rank=r, tp_size=2).targets(stored) == {
            k: tuple(v.shape) for k, v in sorted(want.items())}
    to_titan = unickpt.Mapping.torchtitan_from_hf(config).targets(stored)
    assert to_titan == {k: tuple(v.shape) for k, v in sorted(titan.items())}
    assert unickpt.Mapping.hf_from_torchtitan(config).targets(to_titan) == dict(sorted(stored.items()))
    # a rename passes what it does not take through, under its own name
    m = unickpt.Mapping.rename({r"tok\.(.*)": r"model.embed_tokens.\1"})
    got = m.targets(stored)
    assert "tok.weight" in got and "model.embed_tokens.weight" not in got and len(got) == len(stored)
    # the Hub's per-expert keys -> stacked experts: the expert count read from the names
    moe, mconf = _model("mixtral")
    msd = {k: tuple(v.shape) for k, v in moe.state_dict().items()}
    hub = {k: tuple(v.shape) for k, v in _hub_moe(dict(moe.state_dict())).items()}
    assert unickpt.Mapping.mixtral_experts().targets(hub) == dict(sorted(msd.items()))


def test_targets_refuses_what_it_cannot_honour_typed(llama):
    _, sd, _, config = llama
    stored = {k: tuple(v.shape) for k, v in sd.items()}
    gone = {k: v for k, v in stored.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(TensorMissingError, match="v_proj"):  # a fused target missing a source
        unickpt.Mapping.fused(config, tp_rank=0, tp_size=2).targets(gone)
    fused = dict(unickpt.Mapping.fused(config).targets(stored))  # already fused: a name a rule makes from others
    with pytest.raises(TensorMissingError, match="needs .*gate_proj|needs .*q_proj"):
        unickpt.Mapping.fused(config).targets(fused)
    with pytest.raises(MappingError, match="cannot be listed"):  # a pattern that is not text and groups
        unickpt.Mapping.rename({r"x+\.(.*)": r"\1"}).targets(stored)
    experts = {f"e.{i}.w": (2, 3) for i in (0, 1, 3)}  # expert 2 missing: the stack has a hole
    with pytest.raises(TensorMissingError, match="expert 2"):
        unickpt.Mapping.stacked_experts(r"(e)", r"\1.{e}.w").targets(experts)


def test_load_for_inference_through_a_mapping(llama):
    root, sd, titan, config = llama
    for r in range(2):
        want = _fused_expected(sd, config, r, 2)
        got = unickpt.load_for_inference(str(root / "hf"), options=unickpt.LoadOptions(
            mapping=unickpt.Mapping.fused(config, tp_rank=r, tp_size=2)))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    got = unickpt.load_for_inference(str(root / "hf"), options=unickpt.LoadOptions(
                                     mapping=unickpt.Mapping.torchtitan_from_hf(config)),
                                     keys=["layers.1.attention.*"], dtype=torch.float32)
    assert sorted(got) == sorted(k for k in titan if k.startswith("layers.1.attention."))
    assert all(torch.equal(v, titan[k].float()) for k, v in got.items())
    with pytest.raises(InvalidArgumentError, match="cuts tensor-parallel shards itself"):
        unickpt.load_for_inference(str(root / "hf"), options=unickpt.LoadOptions(mapping=unickpt.Mapping.fused(config)),
                                   tp_rank=0, tp_size=2)
    with pytest.raises(TensorMissingError, match="target of the mapping"):
        unickpt.load_for_inference(str(root / "hf"), options=unickpt.LoadOptions(mapping=unickpt.Mapping.fused(config)),
                                   keys=["*.q_proj.*"])


def test_export_through_a_mapping_gives_a_folder_from_pretrained_loads(llama, tmp_path):
    """A torchtitan checkpoint exported with Hugging Face names (q/k rows permuted): the
    folder loads with from_pretrained and gives the model's logits bit for bit; from the
    CLI too, the heads read from --config."""
    from transformers import AutoModelForCausalLM

    root, sd, _, config = llama
    res = export_hf(str(root / "titan"), str(tmp_path / "a"), mapping=unickpt.Mapping.hf_from_torchtitan(config),
                    config=config)
    assert res["tensors"] == len(sd)
    ref = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ref.load_state_dict(sd)
    ref.save_pretrained(str(tmp_path / "ref"))  # (from_pretrained keeps rotary buffers in fp32: compare like with like)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"))
    ids = torch.arange(11).view(1, -1)
    for folder in ("a", "b"):
        if folder == "b":
            (tmp_path / "config.json").write_text(config.to_json_string())
            p = subprocess.run([sys.executable, "-m", "unickpt", "export", str(root / "titan"), str(tmp_path / "b"),
                                "--from-torchtitan", "--config", str(tmp_path / "config.json")],
                               capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr
        m = AutoModelForCausalLM.from_pretrained(str(tmp_path / folder))
        with torch.no_grad():
            assert torch.equal(m(ids).logits, ref(ids).logits)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(sd)
    p = subprocess.run([sys.executable, "-m", "unickpt", "export", str(root / "titan"), str(tmp_path / "c"),
                        "--from-torchtitan"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--config" in p.stderr and not os.path.exists(tmp_path / "c")


def test_the_dcp_reader_fills_a_state_dict_of_the_mappings_names(llama):
    import torch.distributed.checkpoint as dcp

    root, sd, titan, config = llama
    target = {"model": {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in titan.items()}}  # (DCP casts)
    reader = unickpt.dcp.StorageReader(str(root / "hf"), mapping=unickpt.Mapping.torchtitan_from_hf(config))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target["model"][k], v.float()) for k, v in titan.items())
    with pytest.raises(InvalidArgumentError, match="mapping"):
        unickpt.dcp.StorageReader(str(root / "hf"), mapping={"a": "b"})


def _dcp_experts(rank, world, path):
    """Two ranks, stacked experts as DTensors sharded over the experts (expert parallelism),
    filled by dcp.load from the Hub's per-expert keys through the mapping."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    _, man = unickpt.read_manifest(path)
    m = unickpt.Mapping.mixtral_experts()
    shapes = m.targets({n: t.shape for (r, n), t in man.tensors.items() if r == "model"})
    full = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    unickpt.load({"model": full}, path, group="local", options=unickpt.LoadOptions(mapping=m))
    sd = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}}
    dcp.load(sd, storage_reader=unickpt.dcp.StorageReader(path, mapping=m))
    return all(torch.equal(v.full_tensor(), full[k]) for k, v in sd["model"].items()) and len(full) > 4


def test_the_dcp_reader_maps_into_expert_parallel_dtensors(tmp_path):
    model, _ = _model("mixtral")
    unickpt.save({"model": _hub_moe(dict(model.state_dict()))}, str(tmp_path / "moe"))
    assert dist.run(_dcp_experts, 2, str(tmp_path / "moe")) == [True, True]


def test_transposes_gpt2_conv1d_weights_into_linear_layout_whole_and_as_shards(tmp_path):
    """GPT-2 stores its Conv1D weights [in, out]; an engine holding nn.Linear's [out, in]
    reads them transposed, whole (load_for_inference lists them) and as row or column TP
    shards of the transposed target (the matching box of the source, nothing else)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    unickpt.save({"model": sd}, str(tmp_path / "g"))
    conv = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    m = unickpt.Mapping.transpose(r".*\.(c_attn|c_proj|c_fc)\.weight")
    got = unickpt.load_for_inference(str(tmp_path / "g"), options=unickpt.LoadOptions(mapping=m))
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v.t() if k.endswith(conv) else v), k
    name = "transformer.h.1.mlp.c_fc.weight"  # stored [32, 128]: the target is [128, 32]
    for offsets, sizes in (((64, 0), (64, 32)), ((0, 16), (128, 16)), ((10, 3), (30, 7))):
        local = torch.full(sizes, float("nan"))
        res = unickpt.load({"model": {name: unickpt.shard(local, (128, 32), offsets=offsets)}}, str(tmp_path / "g"),
                           options=unickpt.LoadOptions(mapping=m))
        box = sd[name].t()[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
        assert torch.equal(local, box) and res.tensors == 1
    with pytest.raises(MappingError, match="order"):  # a target of the untransposed shape
        unickpt.load({"model": {name: torch.zeros(32, 128)}}, str(tmp_path / "g"), options=unickpt.LoadOptions(mapping=m))
    for bad in ((0, 0), (1,), (0, 2), "10"):
        with pytest.raises(MappingError, match="perm"):
            unickpt.Mapping.transpose("x", perm=bad)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_transposes_and_their_inverse_over_random_shapes_and_boxes(tmp_path_factory, data):
    """A random tensor of 2-4 dimensions, a random permutation: a random box of the permuted
    target equals the box of ``permute`` by hand; the permuted tensor, saved and read back
    through the inverse permutation (listed by ``targets``), is the original (serving ->
    training -> serving)."""
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=4)))
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=g)
    root = tmp_path_factory.mktemp("tr")
    unickpt.save({"model": {"w": x}}, str(root / "a"))
    t_shape = tuple(shape[p] for p in perm)
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in t_shape)
    sizes = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(t_shape, offsets))
    local = torch.full(sizes, float("nan"))
    m = unickpt.Mapping.transpose("w", perm=perm)
    unickpt.load({"model": {"w": unickpt.shard(local, t_shape, offsets=offsets)}}, str(root / "a"),
                 options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(local, x.permute(perm)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])
    unickpt.save({"model": {"w": x.permute(perm).contiguous()}}, str(root / "b"))
    inv = tuple(perm.index(j) for j in range(len(perm)))
    back = unickpt.load_for_inference(str(root / "b"), options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.transpose("w", perm=inv)))
    assert torch.equal(back["w"], x)


def _fsdp_titan(rank, world, path, titan_path):
    """Three ranks holding torchtitan's Llama as FSDP2-style DTensors (rows sharded, cut inside
    heads where the rows do not split evenly) load a Hugging Face checkpoint through
    torchtitan_from_hf: each rank's rows of the permuted wq/wk equal the torchtitan tensors'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import LlamaConfig

    from tests.test_mapping import HF

    mesh = init_device_mesh("cpu", (world,))
    _, man = unickpt.read_manifest(titan_path)
    full = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for (r, n), t in man.tensors.items() if r == "model"}
    unickpt.load({"model": full}, titan_path, group="local")
    sd = {k: distribute_tensor(torch.full_like(v, float("nan")), mesh, [Shard(0)]) for k, v in full.items()}
    unickpt.load({"model": sd}, path, options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.torchtitan_from_hf(LlamaConfig(**HF))))
    return all(torch.equal(v.full_tensor(), full[k]) for k, v in sd.items())


def test_a_hugging_face_checkpoint_loads_into_torchtitans_fsdp2_shards(llama):
    root, _, _, _ = llama
    assert dist.run(_fsdp_titan, 3, str(root / "hf"), str(root / "titan")) == [True] * 3  # (32 rows: 11, 11, 10)


def test_zero_flat_partitions_take_every_mapping(llama):
    """ZeRO-style flat partitions (3 ranks' ranges of the tensors flattened back to back,
    cut inside rows) of torchtitan's names, of the fused layout and of transposed tensors,
    each read through its mapping: every partition equals the same range of the target
    made by hand (rotary rows permuted, q/k/v side by side, dimensions swapped)."""
    from unickpt.layout import Layout, ShardedTensor, partition_flat

    root, sd, titan, config = llama
    fused = _fused_expected(sd, config, 1, 2)
    transposed = {k: v.t().contiguous() for k, v in sd.items() if v.dim() == 2}
    cases = ((unickpt.Mapping.torchtitan_from_hf(config), titan),
             (unickpt.Mapping.fused(config, tp_rank=1, tp_size=2), fused),
             (unickpt.Mapping.transpose(r".*"), transposed))
    cut_in_rows = 0
    for mapping, want in cases:
        names = sorted(want)
        shapes = [tuple(want[n].shape) for n in names]
        for rank in range(3):
            parts = partition_flat(shapes, 3, rank, names=names)
            cut_in_rows += sum(1 for _, lay, _, _ in parts if lay.flat[0] % lay.sizes[-1] or lay.flat[1] % lay.sizes[-1])
            buf = torch.full((sum(b - a for _, _, a, b in parts),), float("nan"), dtype=torch.bfloat16)
            targets = {names[i]: ShardedTensor(buf[a:b], Layout(lay.shape, lay.offsets, lay.sizes, lay.flat))
                       for i, lay, a, b in parts}
            unickpt.load({"model": targets}, str(root / "hf"), options=unickpt.LoadOptions(mapping=mapping))
            for i, lay, a, b in parts:
                start, stop = lay.flat
                assert torch.equal(buf[a:b], want[names[i]].reshape(-1)[start:stop]), (names[i], rank)
    assert cut_in_rows >= 3  # (ranges that start or stop inside a row: partial rows as boxes)


def test_findings_of_the_second_attack_on_mappings(llama, tmp_path, caplog):
    """From an attack session: each finding now refused typed or done right."""
    import re
    import torch.distributed.checkpoint as dcp

    from unickpt.mapping import _inverse

    # a replacement naming a group the pattern lacks: typed, not re.error
    with pytest.raises(MappingError, match="replacement"):
        unickpt.Mapping.rename({r"(a)": r"\1\2"}).targets({"ab": (2,)})
    # the inverse matches each group as the pattern's own group does: no backtracking over a
    # crafted near-miss name (with `.+?` per group this took hours at 4 groups)
    rx, _ = _inverse(re.compile(r"(\w+)_(\w+)_(\w+)_(\w+)"), r"\1.\2.\3.\4.w")
    assert r"(?:\w+)" in rx.pattern
    name = "x" + ".a" * 2000
    assert unickpt.Mapping.rename({r"(\w+)_(\w+)_(\w+)_(\w+)": r"\1.\2.\3.\4.w"}).targets({name: (1,)}) == {name: (1,)}
    # an empty group is written back too
    assert unickpt.Mapping.rename({r"(.*)weight": r"\1w"}).targets({"w": (2,)}) == {"weight": (2,)}
    # a stored tensor whose name a target takes is said, not dropped silently
    with caplog.at_level("WARNING", logger="unickpt"):
        assert unickpt.Mapping.rename({"w": "v"}).targets({"w": (2,), "v": (3,)}) == {"w": (3,)}
    assert "read by no target" in caplog.text
    # the remembered pieces belong to the rule that made them
    root, sd, _, config = llama
    w = sd["model.layers.0.mlp.down_proj.weight"]
    m = unickpt.Mapping.rename({"t": "model.layers.0.mlp.down_proj.weight"})
    x = torch.zeros(w.shape[1], w.shape[0], dtype=w.dtype)
    unickpt.load({"model": {"t": torch.zeros_like(w)}}, str(root / "hf"), options=unickpt.LoadOptions(mapping=m))
    m.rules.insert(0, unickpt.Mapping.transpose("t", "model.layers.0.mlp.down_proj.weight").rules[0])
    unickpt.load({"model": {"t": x}}, str(root / "hf"), options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(x, w.t())
    # a mapped target read from a tied (alias) name through the DCP reader
    e = torch.randn(4, 3)
    unickpt.save({"model": {"emb": e, "head": e, "x": torch.randn(2)}}, str(tmp_path / "tied" / "step-00000001"))
    sd2 = {"model": {"emb": torch.zeros(4, 3), "out": torch.zeros(4, 3), "x": torch.zeros(2)}}
    dcp.load(sd2, storage_reader=unickpt.dcp.StorageReader(str(tmp_path / "tied"),
                                                         mapping=unickpt.Mapping.rename({"out": "head"})), no_dist=True)
    assert torch.equal(sd2["model"]["out"], e)
    # head counts that are not integers, or contradict the rows, are refused
    with pytest.raises(MappingError):
        unickpt.Mapping.hf_from_torchtitan(num_heads=True, num_kv_heads=2)
    with pytest.raises(MappingError, match="each"):  # 2 heads of 8 rows do not make wq's 32 rows
        unickpt.load({"model": {"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32, dtype=torch.bfloat16)}},
                     str(root / "titan"), options=unickpt.LoadOptions(
                         mapping=unickpt.Mapping.hf_from_torchtitan(num_heads=2, num_kv_heads=2, head_dim=8)))
    for bad in ({"num_attention_heads": True, "num_key_value_heads": 2}, {"num_attention_heads": 4,
                "num_key_value_heads": "2"}, {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}):
        (tmp_path / "c.json").write_text(json.dumps(bad))
        p = subprocess.run([sys.executable, "-m", "unickpt", "export", str(root / "titan"), str(tmp_path / "o"),
                            "--from-torchtitan", "--config", str(tmp_path / "c.json")], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 2 and not os.path.exists(tmp_path / "o"), (bad, p.stderr[-500:])


def test_load_for_inference_takes_its_rare_knobs_in_load_options(llama):
    root, sd, _, _ = llama
    with pytest.warns(DeprecationWarning, match="LoadOptions"):
        got = unickpt.load_for_inference(str(root / "hf"), storage_options=None, keys=["model.norm.weight"])
    assert torch.equal(got["model.norm.weight"], sd["model.norm.weight"])
    with pytest.raises(InvalidArgumentError, match="LoadOptions"):
        unickpt.load_for_inference(str(root / "hf"), mapping=unickpt.Mapping.rename({}))
    with pytest.raises(InvalidArgumentError, match="options"):
        unickpt.load_for_inference(str(root / "hf"), options={"mapping": None})


def test_serving_layouts_read_back_as_training_names(llama, tmp_path):
    """The inverses: a whole fused checkpoint read as Hugging Face's names (Mapping.unfused),
    stacked experts as the Hub's per-expert keys (Mapping.hub_from_stacked_experts), listed
    by targets(), equal to the originals, a row shard of one too."""
    from tests.test_mapping import _hub_moe

    root, sd, _, config = llama
    fused = _fused_expected(sd, config, 0, 1)
    unickpt.save({"model": fused}, str(tmp_path / "fused" / "step-00000001"))
    back = unickpt.load_for_inference(str(tmp_path / "fused"), options=unickpt.LoadOptions(
        mapping=unickpt.Mapping.unfused(config)))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    model, _ = _model("mixtral")
    stacked = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hub = _hub_moe(stacked)
    unickpt.save({"model": stacked}, str(tmp_path / "moe" / "step-00000001"))
    m = unickpt.Mapping.hub_from_stacked_experts()
    back = unickpt.load_for_inference(str(tmp_path / "moe"), options=unickpt.LoadOptions(mapping=m))
    assert sorted(back) == sorted(hub) and all(torch.equal(back[k], v) for k, v in hub.items())
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rows = hub[name].shape[0]
    local = torch.zeros(rows - rows // 2, hub[name].shape[1], dtype=hub[name].dtype)
    unickpt.load({"model": {name: unickpt.shard(local, tuple(hub[name].shape), offsets=(rows // 2, 0))}},
                 str(tmp_path / "moe"), options=unickpt.LoadOptions(mapping=m))
    assert torch.equal(local, hub[name][rows // 2:])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv=st.sampled_from([1, 2, 4]), mult=st.integers(1, 3), hd=st.sampled_from([2, 4, 6]), cols=st.integers(1, 5),
       experts=st.integers(1, 4), inter=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_property_serving_to_training_to_serving_round_trips(tmp_path_factory, kv, mult, hd, cols, experts, inter,
                                                              seed):
    """Over random head counts, widths and expert stacks: serving tensors read as training
    names (unfused, hub_from_stacked_experts) and those read back as serving tensors (fused,
    mixtral_experts) are the serving tensors, bit for bit."""
    heads = kv * mult
    g = torch.Generator().manual_seed(seed)
    p = "model.layers.0."
    serving = {p + "self_attn.qkv_proj.weight": torch.randn((heads + 2 * kv) * hd, cols, generator=g),
               p + "mlp.gate_up_proj.weight": torch.randn(2 * inter, cols, generator=g),
               p + "mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, cols, generator=g),
               p + "mlp.experts.down_proj": torch.randn(experts, cols, inter, generator=g)}
    root = tmp_path_factory.mktemp("rt")
    unickpt.save({"model": serving}, str(root / "serving" / "step-00000001"))
    to_train = unickpt.Mapping.unfused(num_heads=heads, num_kv_heads=kv) + unickpt.Mapping.hub_from_stacked_experts()
    train = unickpt.load_for_inference(str(root / "serving"), options=unickpt.LoadOptions(mapping=to_train))
    assert len(train) == 5 + 3 * experts  # q, k, v, gate, up; w1, w3, w2 per expert
    unickpt.save({"model": train}, str(root / "train" / "step-00000001"))
    to_serve = unickpt.Mapping.fused(num_heads=heads, num_kv_heads=kv) + unickpt.Mapping.mixtral_experts()
    again = unickpt.load_for_inference(str(root / "train"), options=unickpt.LoadOptions(mapping=to_serve))
    assert sorted(again) == sorted(serving)
    assert all(torch.equal(again[k], v) for k, v in serving.items())
