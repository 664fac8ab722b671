"""Findings of the attack on the fused quantizer kernels (f909ba1), kept as regressions: the
compiled kernels index without bounds checks, so every argument they trust is checked before
them (typed errors, never a crash or a read of other memory); narrow groups keep the
decoder's own grid; legal extremes encode, record and decode finite values."""

import math

import numpy as np
import pytest
import torch

import unickpt
from unickpt import codecs
from unickpt.codecs import kernels as k
from unickpt.errors import FormatError, InvalidArgumentError

F = float(torch.finfo(torch.float32).max)


def test_ranges_near_2_63_and_bad_groups_are_refused_not_followed():
    tag = {"codec": "q8_sym", "group": 3}
    lo, hi = (1 << 63) - 1, (1 << 63) + 3
    with pytest.raises(FormatError, match="2\\^62"):
        codecs.decode_range(tag, {"codes": torch.zeros(4, dtype=torch.uint8), "scales": torch.zeros(8, dtype=torch.uint8)},
                            lo, hi)
    with pytest.raises(FormatError, match="group"):
        codecs.encode_chunk({"codec": "q8_sym", "group": -5}, torch.randn(3), 0)
    c, s = k.encode_m(torch.randn(3000), 8, 256)
    for bad in (-256, 0, 2.5):
        with pytest.raises(k.CodecError, match="group"):
            k.decode_m(c, s, 8, bad, 0, 3000)
    c, s = k.encode_mlog(torch.randn(3000), 64)
    with pytest.raises(k.CodecError, match="group"):
        k.decode_mlog(c, s, -64, 1.5, 0, 3000)
    with pytest.raises(k.CodecError, match="outside"):
        k.decode_mlog(c, s, 64, 1.5, -2, 10)
    wc, wl, wh = k.encode_w(torch.rand(3000), 8, 300, 1e-8)
    with pytest.raises(k.CodecError, match="bits"):
        k.decode_w(wc, wl, wh, 7, 300, 1e-8, 0, 3000)
    with pytest.raises(k.CodecError, match="lo"):
        k.decode_w(wc, wl[:1], wh, 8, 300, 1e-8, 0, 3000)  # (used to broadcast one group's range to all)
    with pytest.raises(k.CodecError, match="values needed"):
        k._gathered(wc, False, torch.ones(100), 300, 0, 3000)  # a table that is not one row per group


def test_merge_master_refuses_low_halves_of_another_width_and_mismatched_exceptions():
    model = torch.zeros(4096, dtype=torch.bfloat16)
    with pytest.raises(k.CodecError, match="int16"):
        k.merge_master(model, torch.zeros(4096, dtype=torch.int8), torch.zeros(0, dtype=torch.int64),
                       torch.zeros(0, dtype=torch.int32))
    with pytest.raises(k.CodecError, match="exception"):
        k.merge_master(model, torch.zeros(4096, dtype=torch.int16), torch.zeros(2, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int32))


def _levels_off(v: torch.Tensor, d: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    w, wd = v.double().sqrt() + eps, d.double().sqrt() + eps
    g = w.view(-1, group)
    level = torch.log(g.amax(1) / g.amin(1)) / 255
    return (torch.log(wd / w).abs().view(-1, group) / level[:, None]).amax(1)


def test_narrow_groups_round_on_the_decoders_grid():
    """Rows whose sqrt(v) is far below eps (levels closer than the fast log2's error) were
    several levels off, and their stochastic rounding biased; on the decoder's own grid
    they are within half a level (nearest) and unbiased (stochastic)."""
    eps = float(np.float32(1e-8))
    v = torch.rand(4, 256, generator=torch.Generator().manual_seed(0)).reshape(-1) * 1e-22
    c, lo, hi = k.encode_w(v, 8, 256, eps)
    assert float(_levels_off(v, k.decode_w(c, lo, hi, 8, 256, eps, 0, v.numel()), 256, eps).max()) <= 0.55
    inv = 1 / (v.double().sqrt() + eps)
    mean = torch.zeros_like(inv)
    for seed in range(200):
        c, lo, hi = k.encode_w(v, 8, 256, eps, seed=seed)
        mean += 1 / (k.decode_w(c, lo, hi, 8, 256, eps, 0, v.numel()).double().sqrt() + eps)
    mean /= 200
    level = float(torch.log(hi.double() / lo.double()).max()) / 255
    assert float(((mean - inv) / inv).mean().abs()) < 0.05 * level  # (it was +0.72 levels)


def test_extremes_encode_record_and_decode_finite(tmp_path):
    c, s = k.encode_m(torch.tensor([F, -F, 1.0]), 8, 3)
    assert bool(torch.isfinite(k.decode_m(c, s, 8, 3, 0, 3)).all())
    for quant in ("O1", "O2"):  # squares of moments near 1e19 overflowed the float32 error sums (NaN in JSON)
        st = {"model": {"w": torch.randn(8, 64)}, "optimizer": {"exp_avg": {"w": torch.randn(8, 64) * 1e19},
                                                               "exp_avg_sq": {"w": torch.rand(8, 64) * 1e30}}}
        unickpt.save(st, str(tmp_path / quant), options=unickpt.SaveOptions(compression=unickpt.Compression(quant=quant)))
        _, man = unickpt.read_manifest(str(tmp_path / quant))
        errs = [t.args.get("error") for (r, _), t in man.tensors.items() if r == "optimizer"]
        assert errs and all(e and all(math.isfinite(x) for x in e.values() if isinstance(x, float)) for e in errs), errs
    # a group whose range exceeds float32's (tiny eps): decoded by float64 rows, each value within a level
    v = torch.tensor([0.0, 1e20, 1e24, 1e30, 3e38])
    c, lo, hi = k.encode_w(v, 8, 5, 1e-30)
    d = k.decode_w(c, lo, hi, 8, 5, 1e-30, 0, 5)
    assert bool(torch.isfinite(d).all()) and float(d[1]) < 1e21 and float(d[2]) < 1e25
    ratio = ((d[1:].double().sqrt() + 1e-30) / (v[1:].double().sqrt() + 1e-30))
    step = math.log(float(hi[0]) / float(lo[0])) / 255
    assert float(ratio.log().abs().max()) <= step * 1.01


def test_stored_ranges_no_encoder_writes_are_refused():
    with pytest.raises(FormatError, match="float32"):
        codecs.decode_range({"codec": "q8_sym", "group": 2}, {"codes": torch.tensor([1, 0x80], dtype=torch.uint8),
                            "scales": torch.tensor([3e38]).view(torch.uint8)}, 0, 2)
    with pytest.raises(FormatError, match="range"):
        codecs.decode_range({"codec": "q8_logw", "group": 2, "eps": 1e-8},
                            {"codes": torch.tensor([0, 255], dtype=torch.uint8),
                             "scales": torch.tensor([1e-8, 1e30]).view(torch.uint8)}, 0, 2)


@pytest.mark.parametrize("eps", [1e-46, 0.0, 1e39, float("inf"), float("nan")])
def test_an_eps_float32_cannot_hold_is_refused_at_the_option(eps):
    with pytest.raises(InvalidArgumentError, match="eps"):
        unickpt.Compression(quant="O1", eps=eps)
