"""CLI: inspect (text and --json) and verify (exit codes, naming bad tensors)."""

import json
import os
import subprocess
import sys

import torch

import unickpt


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "unickpt.cli", *args], capture_output=True, text=True)


def _ckpt(tmp_path):
    sd = {
        "model": {"w": torch.randn(8, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "optimizer": {"exp_avg": {"w": torch.randn(8, 8)}},
    }
    unickpt.save(sd, tmp_path / "step-00000003", step=3, strategy={"zero_stage": 1})
    return tmp_path / "step-00000003"


def test_inspect_json(tmp_path):
    p = _ckpt(tmp_path)
    r = _cli("inspect", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for k in ("format_version", "step", "tensors", "bytes_by_role", "files", "saved_by"):
        assert k in info
    assert info["step"] == 3 and info["tensors"] == 3
    assert set(info["bytes_by_role"]) == {"model", "optimizer"}
    assert sum(info["bytes_by_role"].values()) == sum(os.path.getsize(p / f) for f in info["files"])
    assert info["saved_by"]["strategy"] == {"zero_stage": 1}
    r = _cli("inspect", str(p), "--tensors")
    assert r.returncode == 0 and "model/w" in r.stdout and "optimizer/exp_avg.w" in r.stdout


def test_verify_ok_then_corrupted(tmp_path):
    p = _ckpt(tmp_path)
    r = _cli("verify", str(p))
    assert r.returncode == 0 and "ok: 3 tensors" in r.stdout
    _, man = unickpt.read_manifest(p)
    t = man.tensors[("optimizer", "exp_avg.w")]
    with open(p / t.file, "r+b") as f:
        f.seek(man.files[t.file].data_start + t.begin + 17)
        f.write(b"\xff")
    r = _cli("verify", str(p))
    assert r.returncode == 1
    assert f"{t.file}: tensor 'exp_avg.w'" in r.stderr and "1 of 3 tensors failed" in r.stderr


def test_not_a_checkpoint(tmp_path):
    r = _cli("inspect", str(tmp_path / "nope"))
    assert r.returncode == 2 and "CheckpointNotFoundError" in r.stderr


def test_inspect_and_verify_a_compressed_checkpoint(tmp_path):
    w = torch.randn(64, 48)
    sd = {"model": {"w": w.bfloat16()}, "master": {"w": w},
          "optimizer": {"exp_avg": {"w": torch.randn(64, 48)}, "exp_avg_sq": {"w": torch.rand(64, 48)}}}
    unickpt.save(sd, tmp_path / "ck", quant="O2", master="residual", zstd=5)
    info = json.loads(_cli("inspect", str(tmp_path / "ck"), "--json").stdout)
    assert info["compression"]["quant"] == "O2" and info["compression"]["zstd"] == 5
    assert info["codecs"] == {"q4_rinv": 1, "q4_sym": 1, "raw": 1, "residual16": 1}
    assert {f["container"] for f in info["files"].values() if f["role"] != "model"} == {"zstd"}
    assert sum(info["bytes_by_role"].values()) == sum(os.path.getsize(tmp_path / "ck" / f) for f in info["files"])
    text = _cli("inspect", str(tmp_path / "ck"), "--tensors").stdout
    assert "compression  quant O2, master residual, zstd 5" in text and "[q4_sym]" in text
    r = _cli("verify", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
