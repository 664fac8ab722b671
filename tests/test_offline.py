"""Offline tools: `unickpt reshard` and `unickpt convert --from-dcp`, streaming and atomic."""

import json
import os

import pytest
import torch

import unickpt
from tests.clirun import cli


@pytest.fixture
def src(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {f"w{i}": torch.randn(64, 33, generator=g).bfloat16() for i in range(4)},
        "master": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(4)},
        "optimizer": {"exp_avg": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(4)}},
        "trainer": {"step": 9},
    }
    unickpt.save(sd, tmp_path / "src" / "step-00000009", step=9, extra={"x": 1})
    return tmp_path, sd


def test_reshard_drops_roles_splits_files_and_keeps_every_byte(src):
    tmp, sd = src
    r = cli("reshard", str(tmp / "src"), str(tmp / "dst"), "--drop-optimizer", "--max-file-size", "8KiB", "-q")
    assert r.returncode == 0, r.stderr
    ckpt, man = unickpt.read_manifest(tmp / "dst")
    assert {role for role, _ in man.tensors} == {"model", "master"}
    assert len([f for f in man.files if f.startswith("master-")]) > 1
    assert man.step == 9 and man.extra == {"x": 1}
    t = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
         "master": {k: torch.zeros_like(v) for k, v in sd["master"].items()}, "trainer": {"step": 0}}
    res = unickpt.load(t, tmp / "dst", verify="full")
    assert t["trainer"]["step"] == 9 and res.verified > 0
    for role in ("model", "master"):
        for k, v in sd[role].items():
            assert torch.equal(t[role][k], v)
    assert cli("verify", str(tmp / "dst")).returncode == 0


def test_reshard_compresses_and_decompresses_offline(src):
    """O1 + residual masters + zstd, then back to plain: moments within O1's bound (one step,
    stochastic rounding), masters
    bit-exact, model untouched; a distributed load of the compressed copy gives the same
    values as the offline decode."""
    tmp, sd = src
    sd["optimizer"]["exp_avg_sq"] = {}
    r = cli("reshard", str(tmp / "src"), str(tmp / "z"), "--quant", "O1", "--master", "residual", "--zstd", "3", "-q")
    assert r.returncode == 0, r.stderr
    assert "on disk" in r.stdout
    ckpt, man = unickpt.read_manifest(tmp / "z")
    assert man.compression["quant"] == "O1" and man.compression["zstd"] == 3
    assert {f.container for f in man.files.values() if f.role != "model"} == {"zstd"}
    assert {f.container for f in man.files.values() if f.role == "model"} == {"plain"}
    assert man.tensors[("master", "w1")].codec == "residual16"
    assert man.tensors[("optimizer", "exp_avg.w1")].codec == "q8_sym"
    _, before = unickpt.read_manifest(tmp / "src")
    assert man.bytes_by_role()["master"] < 0.6 * before.bytes_by_role()["master"]
    assert cli("verify", str(tmp / "z")).returncode == 0
    r = cli("reshard", str(tmp / "z"), str(tmp / "plain"), "-q")
    assert r.returncode == 0, r.stderr
    t = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
         "master": {k: torch.zeros_like(v) for k, v in sd["master"].items()},
         "optimizer": {"exp_avg": {k: torch.zeros_like(v) for k, v in sd["optimizer"]["exp_avg"].items()}}}
    unickpt.load(t, tmp / "plain", verify="full")
    for k, v in sd["master"].items():
        assert torch.equal(t["master"][k], v)
        assert torch.equal(t["model"][k], sd["model"][k])
        m = sd["optimizer"]["exp_avg"][k]
        err = (t["optimizer"]["exp_avg"][k] - m).abs().max(dim=1).values
        assert bool((err <= m.abs().max(dim=1).values / 127 * 1.0001).all())  # (stochastic rounding: within one step)
    t2 = {"optimizer": {"exp_avg": {k: torch.zeros_like(v) for k, v in sd["optimizer"]["exp_avg"].items()}}}
    unickpt.load(t2, tmp / "z", strict=False)
    for k in sd["master"]:
        assert torch.equal(t2["optimizer"]["exp_avg"][k], t["optimizer"]["exp_avg"][k])


def test_reshard_bad_input_writes_nothing(src):
    tmp, _ = src
    r = cli("reshard", str(tmp / "src"), str(tmp / "src" / "step-00000009"))
    assert r.returncode == 2 and "CheckpointExistsError" in r.stderr
    r = cli("reshard", str(tmp / "src"), str(tmp / "q"), "--quant", "O1", "--zstd", "99")
    assert r.returncode == 2 and "zstd must be" in r.stderr and not (tmp / "q").exists()
    ckpt, man = unickpt.read_manifest(tmp / "src")
    t = man.tensors[("optimizer", "exp_avg.w2")]
    with open(os.path.join(ckpt, t.file), "r+b") as f:
        f.seek(man.files[t.file].data_start + t.begin + 9)
        f.write(b"\x01\x02")
    r = cli("reshard", str(tmp / "src"), str(tmp / "dst"))
    assert r.returncode == 2 and "ChecksumError" in r.stderr and "exp_avg.w2" in r.stderr
    assert sorted(os.listdir(tmp)) == ["src"]  # no destination, no temporary left


def test_reshard_keeps_what_loads_tied_weights_per_rank_values_and_side_files(tmp_path):
    """A reshard changes files, roles and codecs, not what loads: tied weights load from the
    copy, per-rank values keep their marker, and the side files (config.json,
    generation_config.json) come along byte for byte, listed and checked; the index is
    written anew. A side file that does not match its manifest fails the reshard, which
    then leaves nothing behind; a dropped role takes its aliases with it."""
    w = torch.randn(8, 4)
    cfg = '{"model_type": "llama", "hidden_size": 4}'
    sd = {"model": {"emb": w, "head": w, "rng": unickpt.per_rank(torch.arange(3.0))},
          "optimizer": {"exp_avg": {"emb": torch.ones(8, 4)}}}
    unickpt.save(sd, tmp_path / "src", extra_files={"config.json": cfg, "generation_config.json": "{}"})
    _, before = unickpt.read_manifest(tmp_path / "src")
    assert before.aliases and before.per_rank  # what the copy must keep
    r = cli("reshard", tmp_path / "src", tmp_path / "dst", "--max-file-size", "1KiB", "-q")
    assert r.returncode == 0, r.stderr
    _, man = unickpt.read_manifest(tmp_path / "dst")
    assert man.aliases == before.aliases and man.per_rank == before.per_rank
    assert (tmp_path / "dst" / "config.json").read_text() == cfg
    assert (tmp_path / "dst" / "generation_config.json").read_text() == "{}"
    assert set(man.aux) == set(before.aux)
    t = {"model": {"emb": torch.zeros(8, 4), "head": torch.zeros(8, 4), "rng": unickpt.per_rank(torch.zeros(3))}}
    unickpt.load(t, tmp_path / "dst", strict=False)
    assert torch.equal(t["model"]["head"], w) and torch.equal(t["model"]["rng"].value, torch.arange(3.0))
    assert cli("verify", tmp_path / "dst", "-q").returncode == 0

    r = cli("reshard", tmp_path / "src", tmp_path / "m", "--drop-role", "model", "-q")  # the optimizer's stay
    assert r.returncode == 0, r.stderr
    _, m = unickpt.read_manifest(tmp_path / "m")
    assert not m.aliases and not m.per_rank and {role for role, _ in m.tensors} == {"optimizer"}
    unickpt.save({"model": {"w": w}, "trainer": {"lr": 0.1}, "step": 5}, tmp_path / "js")
    r = cli("reshard", tmp_path / "js", tmp_path / "x", "--drop-role", "step", "-q")  # a JSON value, no role
    assert r.returncode == 2 and "the checkpoint has roles model, trainer" in r.stderr, r.stderr

    (tmp_path / "src" / "config.json").write_text(cfg.replace("4", "5"))
    r = cli("reshard", tmp_path / "src", tmp_path / "bad", "-q")
    assert r.returncode == 2 and "ChecksumError" in r.stderr and "config.json" in r.stderr, r.stderr
    assert not (tmp_path / "bad").exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".bad")]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_from_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(1)
    state = {"model": {"a.weight": torch.randn(10, 7, generator=g), "b": torch.arange(5)},
             "optim": {"exp_avg": {"a.weight": torch.randn(10, 7, generator=g)}}, "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = cli("convert", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "uni"))
    assert r.returncode == 0, r.stderr
    _, man = unickpt.read_manifest(tmp_path / "uni")
    assert set(man.tensors) == {("model", "a.weight"), ("model", "b"), ("optim", "exp_avg.a.weight")}
    assert man.extra["skipped_non_tensors"] == [] and man.state["step"] == 3  # non-tensor state is kept
    t = {"model": {"a.weight": torch.zeros(10, 7), "b": torch.zeros(5, dtype=torch.int64)},
         "optim": {"exp_avg": {"a.weight": torch.zeros(10, 7)}}}
    unickpt.load(t, tmp_path / "uni")
    assert torch.equal(t["model"]["a.weight"], state["model"]["a.weight"])
    assert torch.equal(t["optim"]["exp_avg"]["a.weight"], state["optim"]["exp_avg"]["a.weight"])
    assert torch.equal(t["model"]["b"], state["model"]["b"])
    r = cli("convert", "--from-dcp", str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert r.returncode == 2 and not (tmp_path / "x").exists()


def test_reshard_records_the_compression_it_applied(tmp_path):
    """--master/--quant that apply to no tensor (no master role, no moments) are said, and the
    manifest records the policy as applied (inspect showed 'master residual' on raw tensors)."""
    unickpt.save({"model": {"w": torch.ones(4, 4)}}, tmp_path / "ck")
    r = cli("reshard", tmp_path / "ck", tmp_path / "out", "--master", "residual", "--quant", "O1", "-q")
    assert r.returncode == 0, r.stderr
    assert "master='residual' applies to no tensor" in r.stderr and "quant='O1' applies to no tensor" in r.stderr
    assert r.stderr.count("unickpt reshard: warning: ") == 2, r.stderr  # once each, as the command's own
    r = cli("reshard", tmp_path / "ck", tmp_path / "out2", "--master", "residual", "--json")
    said = json.loads(r.stdout)["warnings"]
    assert len(said) == 1 and "master='residual' applies to no tensor" in said[0], said
    comp = unickpt.read_manifest(tmp_path / "out")[1].compression or {}
    assert comp.get("master", "full") == "full" and comp.get("quant") in (None, "O0"), comp


def _two_rank_save(rank, world, root):
    unickpt.save({"model": {"w": torch.ones(4)}, "rng": unickpt.per_rank(torch.full((3,), float(rank))),
                  "pos": unickpt.per_rank({"i": rank})}, os.path.join(root, "src"))


def _two_rank_load(rank, world, root):
    t = {"model": {"w": torch.zeros(4)}, "rng": unickpt.per_rank(torch.zeros(3)), "pos": unickpt.per_rank(None)}
    res = unickpt.load(t, os.path.join(root, "dst"))
    return t["rng"].value.tolist(), t["pos"].value, res.skipped


def test_reshard_of_a_multi_rank_save_keeps_each_ranks_values(tmp_path):
    """Per-rank tensors hold one row per saving rank: the reshard keeps the saving world size
    (it once wrote 1, and the copy's manifest did not read). The manifest is read back before
    the commit, so a copy that would not load is never committed."""
    from tests import dist

    dist.run(_two_rank_save, 2, str(tmp_path))
    r = cli("reshard", tmp_path / "src", tmp_path / "dst", "--zstd", "3", "-q")
    assert r.returncode == 0, r.stderr
    assert dist.run(_two_rank_load, 2, str(tmp_path)) == [([float(r)] * 3, {"i": r}, []) for r in range(2)]
    assert cli("verify", tmp_path / "dst", "-q").returncode == 0


def test_a_copy_whose_manifest_would_not_read_is_not_committed(tmp_path, monkeypatch):
    from unickpt.errors import FormatError
    from unickpt.manifest import Manifest
    from unickpt.offline import reshard_offline

    unickpt.save({"model": {"w": torch.ones(4)}}, tmp_path / "src")
    real = Manifest.from_json

    def refuse(data, where):
        if "dst" in str(where):
            raise FormatError(f"{where}: refused by the test")
        return real(data, where)

    monkeypatch.setattr(Manifest, "from_json", staticmethod(refuse))
    with pytest.raises(FormatError, match="refused by the test"):
        reshard_offline(tmp_path / "src", tmp_path / "dst")
    assert not os.path.exists(tmp_path / "dst") and os.listdir(tmp_path) == ["src"]
