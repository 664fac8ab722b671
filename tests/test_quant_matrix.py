"""Quantized and residual checkpoints under resharding.

Every layout family saves with O1 + residual masters and with O2 + dropped masters (ZeRO
ranges and TP blocks cut through quantization groups: rows for O1, 64-element blocks for
O2); every layout of every world size loads every checkpoint; each rank's pieces must equal
the single-process dequantization of the full tensors, byte for byte (masters: the exact
fp32 values for residual, the bf16 model weights for drop).
"""

import os

import pytest
import torch

import unickpt
from unickpt import codecs
from tests import dist
from tests.layouts import LAYOUTS, assert_same, build, zeros_like_full

SAVE_LAYOUTS = ["full1", "zero3", "tpcol2", "tprow2", "tp2zero2", "dtensor2x2"]
CONFIGS = {"o1-residual": dict(quant="O1", master="residual"), "o2-drop": dict(quant="O2", master="drop"),
           # every file byte-grouped (model, residual masters, codes and scales): bit-exact as without
           "o1-residual-lossless": dict(quant="O1", master="residual", lossless=True)}
EPS = 1e-8
WORLDS = sorted({w for w, _ in LAYOUTS.values()})


def reference_q():
    g = torch.Generator().manual_seed(1)
    shapes = {"embed.weight": (37, 24), "layers.0.qkv.weight": (30, 24), "layers.0.o.weight": (24, 10),
              "layers.0.norm.weight": (24,), "head.weight": (11, 130), "scalar": ()}
    master = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    # ties: the low half exactly 0x8000, half of them needing an exception
    flat = master["embed.weight"].view(-1).view(torch.int32)
    flat[::97] = (flat[::97] & ~0xFFFF) | 0x8000
    model = {k: v.to(torch.bfloat16) for k, v in master.items()}
    model["counter"] = torch.arange(13, dtype=torch.int64)
    m = {k: torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 0, (), generator=g).item() for k, s in shapes.items()}
    m["embed.weight"][3].zero_()  # an all-zero group
    v = {k: torch.rand(s, generator=g) ** 4 * 1e-4 for k, s in shapes.items()}
    v["layers.0.o.weight"][5].fill_(3e-7)  # max == min
    return {"model": model, "master": master, "optimizer": {"exp_avg": m, "exp_avg_sq": v}}


def expected(ref, quant, dropped=(), step=None):
    """Full tensors a load must produce: single-process encoding of each full moment with the
    tag a save of ``step`` gives it (codec, group, rounding seed), decoded; masters exact,
    except those stored as ``from_model`` (``dropped``)."""
    from unickpt import compress

    comp = unickpt.Compression(quant=quant, eps=EPS)
    out = {"model": dict(ref["model"]), "master": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for k, x in ref["master"].items():
        out["master"][k] = ref["model"][k].float() if k in dropped else x.clone()
    for kind in ("exp_avg", "exp_avg_sq"):
        for k, x in ref["optimizer"][kind].items():
            tag = compress.tag_for("optimizer", f"{kind}.{k}", "F32", tuple(x.shape), comp)
            tag = {**tag, **compress.save_args(tag, "optimizer", f"{kind}.{k}", comp, step)}
            parts = {p: torch.cat([d for q, _, d in codecs.encode_chunk(tag, x, 0) if q == p])
                     for p in ("codes", "scales")}
            out["optimizer"][kind][k] = codecs.decode_range(tag, parts, 0, x.numel()).view(x.shape)
    return out


def _save(rank, world, root):
    ref = reference_q()
    for name in SAVE_LAYOUTS:
        if LAYOUTS[name][0] != world:
            continue
        for cfg, kw in CONFIGS.items():
            sd = build(name, ref, rank, world)
            unickpt.save(sd, os.path.join(root, f"{name}-{cfg}"),
                         options=unickpt.SaveOptions(bucket_bytes=4096, compression=unickpt.Compression(**kw)))


def _load(rank, world, root):
    ref = reference_q()
    zeros = zeros_like_full(ref)
    done = 0
    for cfg, kw in CONFIGS.items():
        for src in SAVE_LAYOUTS:
            _, man = unickpt.read_manifest(os.path.join(root, f"{src}-{cfg}"))
            dropped = {n for (r, n), t in man.tensors.items() if r == "master" and t.codec == "from_model"}
            want_full = expected(ref, kw["quant"], dropped)
            for name, (w, _) in LAYOUTS.items():
                if w != world:
                    continue
                target = build(name, zeros, rank, world)
                unickpt.load(target, os.path.join(root, f"{src}-{cfg}"), verify="full")
                assert_same(target, build(name, want_full, rank, world), f"{src}-{cfg} -> {name} (rank {rank})")
                done += 1
    return done


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qmatrix"))
    for w in sorted({LAYOUTS[n][0] for n in SAVE_LAYOUTS}):
        dist.run(_save, w, root)
    return root


@pytest.mark.parametrize("world", WORLDS)
def test_quantized_checkpoints_load_under_every_layout(saved, world):
    n = dist.run(_load, world, saved)[0]
    assert n == len(CONFIGS) * len(SAVE_LAYOUTS) * sum(1 for w, _ in LAYOUTS.values() if w == world)


def test_quantized_checkpoints_are_independent_of_the_saving_layout(saved):
    """Same stored bytes (codes, scales) and manifest entries for the moments and model, whatever
    the saving layout (masters: see the next test, their codec depends on the layout)."""
    for cfg in CONFIGS:
        first = None
        for src in SAVE_LAYOUTS:
            ckpt, man = unickpt.read_manifest(os.path.join(saved, f"{src}-{cfg}"))
            got = {}
            for key, t in man.tensors.items():
                if key[0] == "master":
                    continue
                stored = []
                for part, _, _, _, b, e, _ in t.stored():  # (the logical bytes: framed files through their reader)
                    stored.append((part, _logical(ckpt, man, t.file, man.files[t.file].data_start + b, e - b)))
                got[key] = (t.codec, t.dtype, t.shape, {k: v for k, v in t.args.items()}, stored)
            if first is None:
                first = got
            assert got == first, (cfg, src)


def _logical(ckpt, man, fname, offset, n):
    from unickpt.io.files import open_file
    from unickpt.io.local import LocalStorage

    r = open_file(LocalStorage(), ckpt, man, fname)
    try:
        out = bytearray(n)
        r.readinto(offset, memoryview(out))
        return bytes(out)
    finally:
        r.close()


def test_master_policy_applies_where_model_and_master_share_a_layout(saved):
    """Full tensors, row/column blocks, ZeRO ranges (model and master buffers
    partitioned alike): every master is residual/dropped. Where model and master pieces
    differ on a rank (here the DTensor layout, which picks placements per tensor), those
    masters fall back to full."""
    for src in SAVE_LAYOUTS:
        for cfg, codec in (("o1-residual", "residual16"), ("o2-drop", "from_model"), ("o1-residual-lossless", "residual16")):
            _, man = unickpt.read_manifest(os.path.join(saved, f"{src}-{cfg}"))
            codecs_ = {t.codec for (r, _), t in man.tensors.items() if r == "master"}
            if src == "dtensor2x2":
                assert codecs_ == {codec, "raw"}, (src, cfg, codecs_)
            else:
                assert codecs_ == {codec}, (src, cfg, codecs_)


def test_sizes_and_codecs_recorded(saved):
    ckpt, man = unickpt.read_manifest(os.path.join(saved, "tpcol2-o1-residual"))
    assert man.compression["quant"] == "O1" and man.compression["master"] == "residual"
    assert man.tensors[("optimizer", "exp_avg.embed.weight")].codec == "q8_sym"
    assert man.tensors[("optimizer", "exp_avg_sq.embed.weight")].codec == "q8_logw"
    assert man.tensors[("optimizer", "exp_avg_sq.embed.weight")].args["eps"] == EPS
    res = man.tensors[("master", "embed.weight")]
    assert res.codec == "residual16" and res.nbytes == 37 * 24 * 2
    assert len(res.args["exceptions"][0]) > 0  # the forced ties
    ckpt, man = unickpt.read_manifest(os.path.join(saved, "tprow2-o2-drop"))
    assert man.tensors[("master", "head.weight")].codec == "from_model"
    assert man.bytes_by_role().get("master", 0) == 0
    q = man.tensors[("optimizer", "exp_avg.head.weight")]
    assert q.codec == "q4_logm" and q.parts["codes"].nbytes == 11 * 130 // 2 and q.args["group"] == 64


def test_corrupted_scales_are_detected(saved, tmp_path):
    import shutil

    from unickpt.cli import verify_checkpoint

    src = os.path.join(saved, "zero3-o1-residual")
    dst = str(tmp_path / "bad")
    shutil.copytree(src, dst)
    ckpt, man = unickpt.read_manifest(dst)
    t = man.tensors[("optimizer", "exp_avg_sq.head.weight")]
    part = t.parts["scales"]
    with open(os.path.join(dst, t.file), "r+b") as f:
        f.seek(man.files[t.file].data_start + part.begin + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    bad = verify_checkpoint(ckpt, man)
    assert [(n, "scales" in why) for _, n, why in bad] == [("exp_avg_sq.head.weight", True)]
    ref = reference_q()
    target = zeros_like_full(ref)
    with pytest.raises(unickpt.errors.ChecksumError, match="exp_avg_sq.head.weight"):
        unickpt.load(target, dst)


@pytest.mark.parametrize("quant", ["O1", "O2"])
def test_a_damaged_scale_that_the_decoder_would_refuse_is_a_checksum_error(tmp_path, quant):
    """A flipped exponent bit makes a second moment's group range absurd: the decoder's own
    check would refuse it (FormatError), but the window's ranges are hashed before it
    decodes, so the load names the damage for what it is."""
    g = torch.Generator().manual_seed(11)
    v = (torch.randn(4, 131072, generator=g) * 1e-3).square() + 1e-12
    sd = {"optimizer": {"exp_avg_sq": {"c": v}}}
    d = str(tmp_path / "ck")
    unickpt.save(sd, d, options=unickpt.SaveOptions(compression=unickpt.Compression(quant=quant), step=4))
    _, man = unickpt.read_manifest(d)
    t = man.tensors[("optimizer", "exp_avg_sq.c")]
    p = t.parts["scales"]
    with open(os.path.join(d, t.file), "r+b") as f:  # the high byte of the first scale: its exponent
        f.seek(man.files[t.file].data_start + p.begin + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    for verify in ("auto", "full"):
        got = {"optimizer": {"exp_avg_sq": {"c": torch.zeros_like(v)}}}
        with pytest.raises(unickpt.errors.ChecksumError, match="exp_avg_sq.c"):
            unickpt.load(got, d, options=unickpt.LoadOptions(verify=verify))



def test_residual_falls_back_to_full_where_the_model_is_not_the_bf16_master(tmp_path):
    """Unrelated bf16 weights would make half the elements exceptions: that master is stored
    in full (with a warning), the others as residuals; every master loads bit-exact."""
    g = torch.Generator().manual_seed(3)
    master = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(64, 32, generator=g)}
    model = {"a": master["a"].bfloat16(), "b": torch.randn(64, 32, generator=g).bfloat16()}
    with pytest.warns(UserWarning, match="not the bf16 rounding"):
        unickpt.save({"model": model, "master": master}, tmp_path / "ck", master="residual")
    _, man = unickpt.read_manifest(tmp_path / "ck")
    assert man.tensors[("master", "a")].codec == "residual16"
    assert man.tensors[("master", "b")].codec == "raw"
    got = {"master": {k: torch.zeros_like(v) for k, v in master.items()}}
    unickpt.load(got, tmp_path / "ck", verify="full")
    assert all(torch.equal(got["master"][k], master[k]) for k in master)


@pytest.mark.parametrize("quant", ["O1", "O2"])
def test_empty_scalar_and_odd_sized_moments_round_trip(tmp_path, quant):
    """Empty tensors, 0-d tensors and sizes not divisible by the group, saved compressed with
    zstd, load equal to the single-process dequantization."""
    g = torch.Generator().manual_seed(4)
    m = {"empty": torch.zeros(0, 5), "scalar": torch.tensor(3.5), "odd": torch.randn(3, 67, generator=g), "vec": torch.randn(131, generator=g)}
    v = {k: x.abs() * 1e-5 for k, x in m.items()}
    unickpt.save({"optimizer": {"exp_avg": m, "exp_avg_sq": v}}, tmp_path / "ck", quant=quant, zstd=1)
    want = expected({"model": {}, "master": {}, "optimizer": {"exp_avg": m, "exp_avg_sq": v}}, quant)
    got = {"optimizer": {"exp_avg": {k: torch.full_like(x, 7.0) for k, x in m.items()},
                         "exp_avg_sq": {k: torch.full_like(x, 7.0) for k, x in v.items()}}}
    unickpt.load(got, tmp_path / "ck", verify="full")
    assert_same(got, {"optimizer": want["optimizer"]}, quant)


@pytest.mark.parametrize("quant", ["O1", "O2"])
def test_moments_coded_in_pieces_on_threads_give_the_same_checkpoint(tmp_path, monkeypatch, quant):
    """The writer codes a quantized segment in pieces of whole groups on the coder threads
    (unickpt._coders) and writes them in order: the stored bytes do not depend on the cut,
    the error record only in the last digits of its sums."""
    import json

    from unickpt.saving import writer

    g = torch.Generator().manual_seed(5)
    m = {"rows": torch.randn(300, 130, generator=g) * 1e-3, "vec": torch.randn(10_001, generator=g) * 1e-3}
    v = {k: x.square() for k, x in m.items()}
    sd = {"optimizer": {"exp_avg": m, "exp_avg_sq": v}}
    opts = unickpt.SaveOptions(compression=unickpt.Compression(quant=quant), step=3)
    unickpt.save(sd, tmp_path / "whole", options=opts)
    monkeypatch.setattr(writer, "SUB_CHUNK", 2048)  # many pieces per tensor
    unickpt.save(sd, tmp_path / "pieces", options=opts)

    def data(d):
        return {f: (d / f).read_bytes() for f in sorted(os.listdir(d)) if f.endswith(".safetensors")}
    assert data(tmp_path / "whole") == data(tmp_path / "pieces")
    rec = [json.loads((tmp_path / d / "unickpt.json").read_text())["tensors"]["optimizer"] for d in ("whole", "pieces")]
    assert len(rec[0]) == 4
    for k, t in rec[0].items():
        a, b = t["codec_args"]["error"], rec[1][k]["codec_args"]["error"]
        assert a["max_abs"] == b["max_abs"] and a["rel_l2"] == pytest.approx(b["rel_l2"], rel=1e-3), k
    got = {"optimizer": {"exp_avg": {k: torch.zeros_like(x) for k, x in m.items()},
                         "exp_avg_sq": {k: torch.zeros_like(x) for k, x in v.items()}}}
    unickpt.load(got, tmp_path / "pieces", verify="full")
    want = expected({"model": {}, "master": {}, "optimizer": {"exp_avg": m, "exp_avg_sq": v}}, quant, step=3)
    assert_same(got, {"optimizer": want["optimizer"]}, quant)


def _save_big(rank, world, root):
    """Moments large enough to be written in place (rows: each holder encodes its own
    whole groups) and the same moments as column blocks (gathered to the writer); synchronous
    and asynchronous."""
    g = torch.Generator().manual_seed(7)
    m = {"a": torch.randn(512, 256, generator=g) * 1e-3, "b": torch.randn(640, 384, generator=g) * 1e-4}
    v = {k: x.square() for k, x in m.items()}
    full = {"optimizer": {"exp_avg": m, "exp_avg_sq": v}}
    for quant in ("O1", "O2"):
        opts = unickpt.SaveOptions(compression=unickpt.Compression(quant=quant), step=4)
        for name in ("tprow2", "tpcol2"):
            unickpt.save(build(name, full, rank, world), os.path.join(root, f"{quant}-{name}"), options=opts)
        # FSDP2's Shard(0) (a layout rule, not pieces named one by one): whole rows too
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        dt = {r: {k: {n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in d.items()} for k, d in v.items()}
              for r, v in full.items()}
        unickpt.save(dt, os.path.join(root, f"{quant}-fsdp2"), options=opts)
        unickpt.save_async(build("tprow2", full, rank, world), os.path.join(root, f"{quant}-async"), options=opts).wait()
    return full


def test_codes_written_in_place_by_their_holders_equal_the_gathered_ones(tmp_path):
    full = dist.run(_save_big, 2, str(tmp_path))[0]
    for quant in ("O1", "O2"):
        stored = {}
        for how in ("tprow2", "tpcol2", "async", "fsdp2"):
            ckpt, man = unickpt.read_manifest(tmp_path / f"{quant}-{how}")
            stored[how] = {key: [(part, _logical(ckpt, man, t.file, man.files[t.file].data_start + b, e - b))
                                 for part, _, _, _, b, e, _ in t.stored()] for key, t in man.tensors.items()}
            # in place: each holder hashed its own rows' codes (a range ends where its rows end)
            codes = man.tensors[("optimizer", "exp_avg.b")].parts["codes"]
            split = {e for _, e, _ in codes.checksums} - {codes.end - codes.begin}
            assert (how != "tpcol2") == any(e % (1 << 20) for e in split), (quant, how, split)
            got = zeros_like_full(full)
            unickpt.load(got, tmp_path / f"{quant}-{how}", verify="full")
            want = expected({"model": {}, "master": {}, **full}, quant, step=4)
            assert_same(got, {"optimizer": want["optimizer"]}, f"{quant} {how}")
        assert stored["tprow2"] == stored["tpcol2"] == stored["async"] == stored["fsdp2"], quant
