"""Codecs: error bounds, adversarial inputs, slice-consistent decoding, bit-exact residuals."""

import math

import pytest
import torch

from unickpt.codecs.kernels import (
    CodecError,
    decode_m,
    decode_v,
    encode_m,
    encode_v,
    group_size,
    merge_master,
    pack4,
    split_master,
    unpack4,
)


def _rand(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


def _slice_codes(codes, bits, start, count):
    return codes[start : start + count] if bits == 8 else codes[start // 2 :]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(37, 23), (130,), (5, 4, 3), (1,), (64, 64), (3, 1000)])
def test_m_round_trip_within_half_a_step_per_group(bits, shape):
    n = math.prod(shape)
    group = group_size(shape, bits)
    m = _rand(n, 1) * torch.logspace(-3, 3, n)  # wide dynamic range across groups
    codes, scale = encode_m(m, bits, group)
    dq = decode_m(codes, scale, bits, group, 0, n)
    qmax = 127 if bits == 8 else 7
    bound = (scale / 2).repeat_interleave(group)[:n] * (1 + 1e-6) + 1e-30
    assert bool(((dq - m).abs() <= bound).all())
    assert scale.numel() == -(-n // group)
    assert codes.numel() == (n if bits == 8 else -(-n // 2))
    assert float(dq.abs().max()) <= float(m.abs().max()) * (1 + 1e-6)
    assert qmax


@pytest.mark.parametrize("bits", [8, 4])
def test_v_round_trip_bound_on_r(bits):
    n, eps = 1000, 1e-8
    v = _rand(n, 2).square() * 1e-4 + 1e-12
    group = group_size((n,), bits, 64)
    codes, lo, hi = encode_v(v, bits, group, eps)
    dv = decode_v(codes, lo, hi, bits, group, eps, 0, n)
    r, dr = 1 / (v.sqrt() + eps), 1 / (dv.sqrt() + eps)
    step = ((hi - lo) / ((1 << bits) - 1)).repeat_interleave(group)[:n]
    assert bool(((dr - r).abs() <= step / 2 * 1.001 + r * 1e-6).all())
    assert bool((dv >= 0).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial_groups(bits):
    group = 64 if bits == 4 else 2048
    n = 3 * group + 5  # not divisible by the group
    m = torch.zeros(n)
    m[group : 2 * group] = torch.tensor(1e-40)  # denormals
    m[2 * group :] = _rand(n - 2 * group, 3) * 1e30  # huge values
    codes, scale = encode_m(m, bits, group)
    dq = decode_m(codes, scale, bits, group, 0, n)
    assert bool((dq[:group] == 0).all())  # all-zero group decodes to exact zeros
    assert bool((dq[group : 2 * group] - m[group : 2 * group]).abs().le(1e-40).all())
    rel = ((dq[2 * group :] - m[2 * group :]).abs() / m[2 * group :].abs().amax()).max()
    assert float(rel) <= 0.5 / (127 if bits == 8 else 7) + 1e-6
    v = torch.full((n,), 0.25)  # max == min in every group: decodes exactly
    c, lo, hi = encode_v(v, bits, group, 1e-8)
    assert torch.allclose(decode_v(c, lo, hi, bits, group, 1e-8, 0, n), v, rtol=1e-6, atol=0)
    z = torch.zeros(n)  # v = 0 everywhere: r = 1/eps
    c, lo, hi = encode_v(z, bits, group, 1e-8)
    assert bool((decode_v(c, lo, hi, bits, group, 1e-8, 0, n) <= 1e-20).all())


def test_non_finite_and_negative_are_refused_naming_the_element():
    x = torch.ones(10)
    x[7] = float("nan")
    with pytest.raises(CodecError, match="exp_avg.w: non-finite value nan at element 7"):
        encode_m(x, 8, 2048, what="exp_avg.w")
    y = torch.ones(10)
    y[3] = float("inf")
    with pytest.raises(CodecError, match="element 3"):
        encode_v(y, 4, 64, 1e-8)
    with pytest.raises(CodecError, match="negative second moment at element 2"):
        encode_v(torch.tensor([1.0, 0.0, -1e-9]), 8, 2048, 1e-8)


@pytest.mark.parametrize("bucket_bytes", [None, 4096])
def test_a_save_refusing_a_moment_names_the_tensor_and_its_own_element(tmp_path, bucket_bytes):
    """Saves encode moments bucket by bucket: the refused element is the tensor's, not the
    bucket's, and the error names the tensor (found by an attacker's review)."""
    import unickpt

    m = torch.ones(300, 256)
    m.view(-1)[70123] = float("nan")
    sd = {"optimizer": {"state.0.exp_avg": m, "state.0.exp_avg_sq": torch.ones(300, 256)}}
    kw = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
    with pytest.raises(CodecError, match=r"tensor 'state.0.exp_avg' \(role optimizer\): non-finite value nan at "
                                         r"element 70123;"):
        unickpt.save(sd, tmp_path / "c", quant="O1", **kw)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("bits", [8, 4])
def test_empty_and_scalar(bits):
    for t in (torch.zeros(0), torch.tensor([3.5])):
        g = group_size(tuple(t.shape), bits)
        codes, scale = encode_m(t, bits, g)
        assert torch.allclose(decode_m(codes, scale, bits, g, 0, t.numel()), t, rtol=0.1)


@pytest.mark.parametrize("bits", [8, 4])
def test_any_slice_decodes_like_the_full_tensor(bits):
    """Groups are fixed on the full tensor: a ZeRO range or a TP block decodes its part exactly
    as a single process decoding everything would."""
    shape = (23, 37)
    n = 23 * 37
    group = group_size(shape, bits)
    m = _rand(n, 5)
    v = _rand(n, 6).square()
    mc, ms = encode_m(m, bits, group)
    vc, vl, vh = encode_v(v, bits, group, 1e-8)
    full_m = decode_m(mc, ms, bits, group, 0, n)
    full_v = decode_v(vc, vl, vh, bits, group, 1e-8, 0, n)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(a, n + 1, (1,), generator=g))
        k = b - a
        got = decode_m(_slice_codes(mc, bits, a, k), ms[a // group :], bits, group, a, k)
        assert torch.equal(got, full_m[a:b])
        got = decode_v(_slice_codes(vc, bits, a, k), vl[a // group :], vh[a // group :], bits, group, 1e-8, a, k)
        assert torch.equal(got, full_v[a:b])


def test_pack4_layout():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3)[:45]
    packed = pack4(codes)
    assert packed.numel() == 23 and int(packed[0]) == 0x10 and int(packed[1]) == 0x32
    for a in (0, 1, 5, 44):
        assert torch.equal(unpack4(packed[a // 2 :], a, 45 - a), codes[a:])


def _specials():
    vals = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38]
    )
    nan_payloads = torch.tensor([0x7FC00000, 0x7FC12345, 0xFFC00001 - (1 << 32), 0x7F800001, 0x7FBFFFFF], dtype=torch.int64)
    return torch.cat([vals, nan_payloads.to(torch.int32).view(torch.float32)])


def test_residual_is_bit_exact_on_ten_million_values_with_ties_and_specials():
    g = torch.Generator().manual_seed(7)
    n = 10_000_000
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    # force ties (low half 0x8000) with odd and even upper halves, and near-overflow values
    bits[:200_000] = (bits[:200_000] & ~0xFFFF) | 0x8000
    bits[200_000:200_100] = 0x7F7F8000
    bits[200_100:200_200] = 0x7F7FFFFF
    master = bits.view(torch.float32).clone()
    master[-16:] = _specials()
    model = master.to(torch.bfloat16)  # what a trainer's bf16 weights are: round to nearest even
    res = split_master(master, model)
    assert res.low.dtype == torch.int16 and res.low.numel() == n
    # exceptions only where 16 bits cannot decide: ties (low half 0x8000) and NaN payloads
    low = master.view(torch.int32)[res.exc_index] & 0xFFFF
    assert bool(((low == 0x8000) | torch.isnan(master[res.exc_index])).all())
    assert res.exc_index.numel() <= 101_000 + 100 + int(torch.isnan(master).sum())  # about half the ties
    back = merge_master(model, res.low, res.exc_index, res.exc_bits)
    assert torch.equal(back.view(torch.int32), master.view(torch.int32))
    # any slice rebuilds from its own range plus the exceptions that fall inside it
    for a, b in ((0, 1000), (199_990, 200_300), (n - 100, n)):
        part = merge_master(model[a:b], res.low[a:b], res.exc_index, res.exc_bits, start=a)
        assert torch.equal(part.view(torch.int32), master[a:b].view(torch.int32))
