"""Quantized moments that do not wear training down (issue #36): no code of the second-moment
encoding decodes to a value that blows the Adam update up, rounding is unbiased where the
update uses the values, deterministic and independent of how the tensor is cut, and every
quantized tensor records its error and its lossy generations (the error budget)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import unickpt
from tests.clirun import cli
from unickpt.codecs import kernels as codecs
from unickpt.errors import InvalidArgumentError

EPS = 1e-8


def _groups_of_every_range():
    """Groups of v whose w = sqrt(v) + eps spans from one value to the widest range fp32 and
    eps allow: zeros (w = eps), denormals, ordinary gradients, huge values."""
    out = [torch.full((64,), 3e-7), torch.zeros(64)]
    for lo_exp, hi_exp in ((-40, -30), (-20, -2), (-16, 0), (-45, 6), (-12, -11.9), (-30, 30)):
        e = torch.linspace(lo_exp, hi_exp, 64, dtype=torch.float64)
        out.append((10.0 ** e).float())
    z = (10.0 ** torch.linspace(-18, -4, 64, dtype=torch.float64)).float()
    z[::7] = 0.0  # zeros inside a group of ordinary values: w = eps there
    out.append(z)
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("codec", ["logw", "rinv"])
def test_no_code_of_the_second_moment_decodes_to_an_update_larger_than_the_group_had(bits, codec):
    """For every group range and EVERY code (not only those a value rounds to): the decoded
    Adam denominator sqrt(v') + eps lies within the group's [min, max] of sqrt(v) + eps at
    save, so no code gives an element an update larger than the largest the group had (no
    zero denominator, whatever the range). For logw each code is also within one level of
    every value that can round to it."""
    levels = (1 << bits) - 1
    for v in _groups_of_every_range():
        w = v.double().sqrt() + EPS
        enc = codecs.encode_w if codec == "logw" else codecs.encode_v
        _, lo, hi = enc(v, bits, 64, EPS)
        every = torch.arange(levels + 1, dtype=torch.uint8).repeat(-(-64 // (levels + 1)))[:64]
        codes = every if bits == 8 else codecs.pack4(every)
        dec = (codecs.decode_w if codec == "logw" else codecs.decode_v)(codes, lo, hi, bits, 64, EPS, 0, 64)
        assert bool(torch.isfinite(dec).all()) and bool((dec >= 0).all())
        wd = dec.double().sqrt() + EPS
        slack = 1 + 1e-5  # fp32 arithmetic of the decode
        assert float(wd.min()) >= float(w.min()) / slack, (codec, bits, float(wd.min()), float(w.min()))
        assert float(wd.max()) <= float(w.max()) * slack, (codec, bits, float(wd.max()), float(w.max()))
        if codec == "logw":
            # one level's ratio bounds how far a code is from any value it stands for
            rho = (float(w.max()) / float(w.min())) ** (1 / levels)
            got = codecs.decode_w(*codecs.encode_w(v, bits, 64, EPS, seed=7), bits, 64, EPS, 0, 64).double().sqrt() + EPS
            ratio = got / w
            assert float(ratio.max()) <= rho * slack and float(ratio.min()) >= 1 / (rho * slack), (bits, rho)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_of_the_second_moment_is_unbiased_where_the_update_uses_it(bits):
    """Over many seeds the mean of 1/(sqrt(v')+eps), what Adam multiplies m by, equals
    1/(sqrt(v)+eps) within what chance allows (five standard deviations of the mean); to
    nearest, the same values err the same way every time, further."""
    g = torch.Generator().manual_seed(3)
    n, group, draws = 256, 64, 400
    v = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 1e-3) ** 2
    inv = 1 / (v.double().sqrt() + EPS)
    sum_inv = torch.zeros(n, dtype=torch.float64)
    for seed in range(draws):
        c, lo, hi = codecs.encode_w(v, bits, group, EPS, seed=10_000 + seed)
        sum_inv += 1 / (codecs.decode_w(c, lo, hi, bits, group, EPS, 0, n).double().sqrt() + EPS)
    w = v.double().sqrt() + EPS
    rho = (w.view(-1, group).amax(1) / w.view(-1, group).amin(1)) ** (1 / ((1 << bits) - 1))
    # a draw is one of two neighbouring levels (ratio rho): its std is at most inv * (rho - 1) / 2
    tol = 5 * inv * (rho.repeat_interleave(group) - 1) / 2 / math.sqrt(draws)
    assert bool(((sum_inv / draws - inv).abs() <= tol + 1e-9 * inv).all())
    c, lo, hi = codecs.encode_w(v, bits, group, EPS)
    nearest = 1 / (codecs.decode_w(c, lo, hi, bits, group, EPS, 0, n).double().sqrt() + EPS)
    assert float((nearest - inv).abs().max()) > float(((sum_inv / draws) - inv).abs().max())


def test_the_4bit_first_moment_code_keeps_small_values_and_magnitudes():
    """q4_logm: each value within half a level (in log space) of itself, values down to the
    smallest level kept (15 linear levels flush everything below absmax/14 to zero), zeros
    and all-zero groups exact, every code within [-absmax, absmax]."""
    g = torch.Generator().manual_seed(8)
    m = torch.randn(64 * 50, generator=g) * torch.exp(torch.randn(64 * 50, generator=g) * 1.5)
    m[64 * 3 : 64 * 4] = 0.0
    m[7] = 0.0
    c, s = codecs.encode_mlog(m, 64, codecs.M_RATIO)
    d = codecs.decode_mlog(c, s, 64, codecs.M_RATIO, 0, m.numel())
    amax = m.view(-1, 64).abs().amax(1).repeat_interleave(64)
    kept = (m != 0) & (m.abs() >= amax * codecs.M_RATIO ** -6)
    ratio = (d[kept] / m[kept]).double()
    assert bool((ratio > 0).all()) and float(ratio.max()) <= math.sqrt(codecs.M_RATIO) * 1.0001
    assert float(ratio.min()) >= 1 / math.sqrt(codecs.M_RATIO) / 1.0001
    assert d[7] == 0 and bool((d[64 * 3 : 64 * 4] == 0).all())
    every = codecs.pack4(torch.arange(16, dtype=torch.uint8).repeat(4))
    out = codecs.decode_mlog(every, torch.tensor([2.0]), 64, codecs.M_RATIO, 0, 64)
    assert float(out.abs().max()) <= 2.0 and bool(torch.isfinite(out).all())
    lin_c, lin_s = codecs.encode_m(m, 4, 64)
    lin = codecs.decode_m(lin_c, lin_s, 4, 64, 0, m.numel())
    flushed = (m.abs() < amax / 14) & (m.abs() >= amax * codecs.M_RATIO ** -6 / 2)  # what 15 linear levels lose
    assert int(flushed.sum()) > 50 and bool((lin[flushed] == 0).all()) and bool((d[flushed] != 0).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_is_deterministic_and_independent_of_the_chunks(bits):
    """The same seed gives the same codes; encoding any group-aligned chunks of the tensor
    separately (as ranks and writers cut it) gives the codes of the whole."""
    g = torch.Generator().manual_seed(5)
    n, group = 64 * 37 + 10, 64
    m = torch.randn(n, generator=g)
    v = torch.rand(n, generator=g) ** 4
    whole_v, lo, hi = codecs.encode_w(v, bits, group, EPS, seed=99)
    assert torch.equal(codecs.encode_w(v, bits, group, EPS, seed=99)[0], whole_v)
    whole_m = codecs.encode_mlog(m, group)[0] if bits == 4 else codecs.encode_m(m, bits, group)[0]
    for cut in (64, 64 * 5, 64 * 11):
        parts_m, parts_v = [], []
        for a in range(0, n, cut):
            b = min(n, a + cut)
            parts_m.append(codecs.encode_mlog(m[a:b], group, base=a)[0] if bits == 4 else
                           codecs.encode_m(m[a:b], bits, group, base=a)[0])
            parts_v.append(codecs.encode_w(v[a:b], bits, group, EPS, base=a, seed=99)[0])
        assert torch.equal(torch.cat(parts_m), whole_m) and torch.equal(torch.cat(parts_v), whole_v), cut
    other = codecs.encode_w(v, bits, group, EPS, seed=100)[0]
    assert not torch.equal(other, whole_v)  # another step's seed: other rounding


def test_dither_is_addressed_by_element():
    full = codecs.dither(11, 0, 1000)
    for a in (0, 1, 3, 4, 5, 997):
        assert torch.equal(codecs.dither(11, a, 1000 - a), full[a:])
    u = codecs.dither(11, (1 << 40) + 5, 1 << 16)
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


def _moments(seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(32, 48, generator=g) * 1e-3 for _ in range(3)]
    m = {f"w{i}": 0.1 * x for i, x in enumerate(grads)}
    v = {f"w{i}": 0.05 * x * x for i, x in enumerate(grads)}
    return {"model": {k: torch.randn(32, 48, generator=g) for k in m}, "optimizer": {"exp_avg": m, "exp_avg_sq": v}}


def test_every_quantized_tensor_records_its_error_and_generations_and_inspect_shows_them(tmp_path):
    sd = _moments()
    unickpt.save(sd, tmp_path / "g1", quant="O2", step=10)
    _, man = unickpt.read_manifest(tmp_path / "g1")
    assert man.lossy_generations == 1 and man.compression["lossy_generations"] == 1
    for (role, name), t in man.tensors.items():
        if role != "optimizer":
            continue
        assert t.codec in ("q4_logm", "q4_logw") and t.args["generations"] == 1
        assert type(t.args["seed"]) is int if t.codec == "q4_logw" else t.args["ratio"] == codecs.M_RATIO
        kind = "exp_avg_sq" if "exp_avg_sq" in name else "exp_avg"
        orig = sd["optimizer"][kind][name.split(".", 1)[1]]
        target = torch.zeros_like(orig)
        unickpt.load({"optimizer": {kind: {name.split(".", 1)[1]: target}}}, tmp_path / "g1", strict=False)
        rel = float((target - orig).double().norm() / orig.double().norm())
        assert t.args["error"]["rel_l2"] == pytest.approx(rel, rel=1e-3), name
        assert t.args["error"]["max_abs"] == pytest.approx(float((target - orig).abs().max()), rel=1e-6)
    # a state resumed from it and saved lossy again: two generations; an O0 save keeps the count
    t = _moments(1)
    res = unickpt.load(t, tmp_path / "g1")
    assert res.lossy_generations == 1
    unickpt.save(t, tmp_path / "g2", quant="O2", step=20, lossy_generations=res.lossy_generations)
    assert unickpt.read_manifest(tmp_path / "g2")[1].lossy_generations == 2
    unickpt.save(t, tmp_path / "g2-o0", step=20, lossy_generations=2)
    assert unickpt.load(_moments(2), tmp_path / "g2-o0").lossy_generations == 2
    r = cli("inspect", tmp_path / "g2", "--json")
    info = json.loads(r.stdout)
    q = info["quantization"]["optimizer"]
    assert q["generations"] == 2 and 0 < q["max_rel_l2"] < 1 and q["max_abs"] > 0, q
    text = cli("inspect", tmp_path / "g2").stdout
    assert "lossy generations 2" in text and "rel L2" in text, text


def test_the_error_budget_falls_back_to_lossless_or_refuses(tmp_path, caplog):
    sd = _moments()
    comp = unickpt.Compression(quant="O1", max_generations=2)
    unickpt.save(sd, tmp_path / "a", compression=comp, lossy_generations=1)  # the 2nd: within the budget
    _, man = unickpt.read_manifest(tmp_path / "a")
    assert man.lossy_generations == 2 and {t.codec for t in man.tensors.values()} >= {"q8_sym", "q8_logw"}
    with caplog.at_level("WARNING", logger="unickpt"):
        unickpt.save(sd, tmp_path / "b", compression=comp, lossy_generations=2)  # spent: stored as they are
    _, man = unickpt.read_manifest(tmp_path / "b")
    assert {t.codec for t in man.tensors.values()} == {"raw"} and man.lossy_generations == 2
    assert any("error budget is spent" in r.message for r in caplog.records)
    t = _moments(3)
    unickpt.load(t, tmp_path / "b")
    assert all(torch.equal(t["optimizer"][k][n], sd["optimizer"][k][n]) for k in t["optimizer"] for n in t["optimizer"][k])
    refuse = unickpt.Compression(quant="O1", max_generations=2, over_budget="refuse")
    with pytest.raises(InvalidArgumentError, match="error budget is spent"):
        unickpt.save(sd, tmp_path / "c", compression=refuse, lossy_generations=2)
    assert not (tmp_path / "c").exists()
    with pytest.raises(InvalidArgumentError):
        unickpt.Compression(quant="O1", max_generations=-1)
    with pytest.raises(InvalidArgumentError):
        unickpt.save(sd, tmp_path / "d", quant="O1", lossy_generations=-1)


def test_reshard_counts_a_generation_when_it_quantizes(tmp_path):
    sd = _moments()
    unickpt.save(sd, tmp_path / "src", quant="O1")
    assert cli("reshard", tmp_path / "src", tmp_path / "o2", "--quant", "O2", "-q").returncode == 0
    _, man = unickpt.read_manifest(tmp_path / "o2")
    assert man.lossy_generations == 2
    assert all(t.args["generations"] == 2 and "rel_l2" in t.args["error"]
               for t in man.tensors.values() if t.coder.quantized)
    assert cli("reshard", tmp_path / "o2", tmp_path / "plain", "-q").returncode == 0
    assert unickpt.read_manifest(tmp_path / "plain")[1].lossy_generations == 2


def test_old_checkpoints_with_the_linear_code_still_load_and_count_one_generation(tmp_path):
    """Checkpoints written before (``q8_rinv``, no generations recorded) load as they did."""
    import os

    golden = os.path.join(os.path.dirname(__file__), "golden", "v1", "o1")
    _, man = unickpt.read_manifest(golden)
    assert {t.codec for t in man.tensors.values()} >= {"q8_rinv"} and man.lossy_generations == 1


def test_saves_at_other_steps_reuse_the_cached_plan(tmp_path, monkeypatch):
    """The rounding seed changes with the step, but it is not part of the plan: a trainer
    saving quantized every N steps keeps reusing its plan (planning is the cost at scale)."""
    from unickpt.saving import pipeline

    made = []
    real = pipeline.make_plan
    monkeypatch.setattr(pipeline, "make_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    pipeline._PLAN_CACHE.clear()
    sd = _moments()
    for step in (10, 20, 30):
        unickpt.save(sd, tmp_path / f"step-{step:08d}", step=step, quant="O2")
    assert len(made) == 1
    seeds = {unickpt.read_manifest(tmp_path / f"step-{s:08d}")[1].tensors[("optimizer", "exp_avg_sq.w0")].args["seed"]
             for s in (10, 20, 30)}
    assert len(seeds) == 3  # each step rounds with its own seed
