"""Save under every layout, load under every other one: bit-exact.

Two passes of real gloo jobs, one job per world size and pass: first every layout saves the
reference state; then every layout loads every checkpoint and compares its local pieces
with the reference, byte for byte. Plus a plain single-process ``safetensors`` read.
"""

import os

import pytest
import torch
import xxhash
from safetensors import safe_open

import unickpt
from tests import dist
from tests.layouts import LAYOUTS, assert_same, build, reference, zeros_like_full

WORLDS = sorted({w for w, _ in LAYOUTS.values()})


def _save_all(rank, world, root):
    """Each layout saves twice: with the default routing (large pieces written in place by
    their holders, the rest gathered in 4 KiB buckets) and with every piece written in place
    (thousands of sub-page runs: exercises the O_DIRECT edge-page merging)."""
    import unickpt.plan

    ref = reference()
    out = {}
    default = unickpt.plan.make.DIRECT_MIN_RUN
    for name, (w, _) in LAYOUTS.items():
        if w != world:
            continue
        for suffix, min_run in (("", default), ("-direct", 1)):
            unickpt.plan.make.DIRECT_MIN_RUN = min_run
            sd = build(name, ref, rank, world)
            sd["step"] = 5
            r = unickpt.save(sd, os.path.join(root, name + suffix), step=5, bucket_bytes=4096, strategy={"layout": name})
            out[name + suffix] = r.files
    unickpt.plan.make.DIRECT_MIN_RUN = default
    return out


SAVED = sorted(LAYOUTS) + sorted(n + "-direct" for n in LAYOUTS)


def _load_all(rank, world, root):
    ref = reference()
    zeros = zeros_like_full(ref)
    done = []
    for src in SAVED:
        for name, (w, _) in LAYOUTS.items():
            if w != world:
                continue
            target = build(name, zeros, rank, world)
            target["step"] = -1
            res = unickpt.load(target, os.path.join(root, src))
            assert target.pop("step") == 5
            assert_same(target, build(name, ref, rank, world), f"{src} -> {name} (rank {rank})")
            assert res.step == 5
            done.append((src, name))
    return done


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("matrix"))
    for w in WORLDS:
        dist.run(_save_all, w, root)
    return root


def test_every_layout_saved_a_committed_checkpoint(saved):
    for name in SAVED:
        assert os.path.exists(os.path.join(saved, name, "unickpt.json")), name
        ckpt, man = unickpt.read_manifest(os.path.join(saved, name))
        base = name.removesuffix("-direct")
        assert man.saved_by["strategy"] == {"layout": base}
        assert man.saved_by["world_size"] == LAYOUTS[base][0]


@pytest.mark.parametrize("world", WORLDS)
def test_load_every_checkpoint_under_every_layout(saved, world):
    pairs = dist.run(_load_all, world, saved)[0]
    n_targets = sum(1 for w, _ in LAYOUTS.values() if w == world)
    assert len(pairs) == len(SAVED) * n_targets


def test_plain_safetensors_reads_full_tensors(saved):
    ref = reference()
    for name in SAVED:
        d = os.path.join(saved, name)
        found = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as fh:
                    for k in fh.keys():
                        found[(f.split("-")[0], k)] = fh.get_tensor(k)
        for n, t in ref["model"].items():
            assert torch.equal(found[("model", n)], t), (name, n)
        for n, t in ref["optimizer"]["exp_avg"].items():
            assert torch.equal(found[("optimizer", f"exp_avg.{n}")], t), (name, n)


def test_checkpoints_do_not_depend_on_the_saving_layout(saved):
    """Whole tensors: every layout stores the same bytes for every tensor, and verifies."""
    from unickpt.cli import verify_checkpoint

    def digests(name):
        ckpt, man = unickpt.read_manifest(os.path.join(saved, name))
        assert verify_checkpoint(ckpt, man) == []
        out = {}
        for (role, n), t in man.tensors.items():
            with open(os.path.join(ckpt, t.file), "rb") as f:
                f.seek(man.files[t.file].data_start + t.begin)
                out[(role, n)] = (t.dtype, t.shape, xxhash.xxh3_64_hexdigest(f.read(t.nbytes)))
        return out

    first = digests("full1")
    for name in SAVED:
        assert digests(name) == first, name
