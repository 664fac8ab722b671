"""Backward compatibility: checkpoints of format 1 (committed under tests/golden/v1, made by
tests/golden/make_v1.py with unickpt 0.1.0) keep loading bit-identically; a newer major
format is refused with a message that says to upgrade."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import unickpt
from unickpt.errors import FormatError

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _targets(man):
    sd: dict = {}
    for (r, n), t in man.tensors.items():
        sd.setdefault(r, {})[n] = torch.full(t.shape, 77, dtype={"F32": torch.float32, "BF16": torch.bfloat16}[t.dtype])
    return sd


@pytest.mark.parametrize("kind", ["plain", "o1"])
def test_format_1_checkpoints_keep_loading_bit_identically(kind):
    expected = load_file(os.path.join(GOLDEN, "v1_expected.safetensors"))
    path = os.path.join(GOLDEN, "v1", kind)
    _, man = unickpt.read_manifest(path)
    assert man.format_version == 1
    sd = _targets(man)
    res = unickpt.load(sd, path)
    assert res.step == 7 and res.verified > 0
    for r, group in sd.items():
        for n, x in group.items():
            assert torch.equal(x, expected[f"{kind}/{r}/{n}"]), (kind, r, n)


def test_format_1_checkpoint_loads_sliced_and_verifies_every_byte(tmp_path):
    """A sliced load of an old checkpoint (one checksum per tensor) still verifies what it returns."""
    src = os.path.join(GOLDEN, "v1", "plain")
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    _, man = unickpt.read_manifest(dst)
    t = man.tensors[("model", "layer.weight")]
    fe = man.files[t.file]
    with open(dst / t.file, "r+b") as f:  # flip a bit in row 60, outside the slice read below
        f.seek(fe.data_start + t.begin + 60 * 32 * 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    target = unickpt.shard(torch.zeros(8, 32, dtype=torch.bfloat16), (64, 32), offsets=(0, 0))
    with pytest.raises(unickpt.errors.ChecksumError):
        unickpt.load({"model": {"layer.weight": target}}, dst, group="local", strict=False)


def test_a_newer_major_format_is_refused_with_upgrade_advice(tmp_path):
    dst = tmp_path / "future"
    shutil.copytree(os.path.join(GOLDEN, "v1", "plain"), dst)
    obj = json.loads((dst / "unickpt.json").read_bytes())
    obj["format_version"] = 99
    (dst / "unickpt.json").write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="upgrade unickpt"):
        unickpt.read_manifest(dst)
