"""Regression tests of the third attack round (during #37): a memory directory reached through
another user's symbolic link, an object store that lists for ever, crafted error-budget and
scale fields in a manifest."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import unickpt
from tests.dist import apply_env
from tests.s3server import LoopbackServer, offline_env
from tests.test_trust_round2 import _TRICKLE_CALL
from unickpt.errors import InvalidArgumentError

HANG_GUARD_S = 300  # a hang guard only: the calls below fail within seconds


# -- F1: a memory directory reached through another user's link ----------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a link to another user (lchown)")
def test_a_memory_dir_reached_through_another_users_link_is_refused(tmp_path):
    """Another user's link in a sticky directory (``/dev/shm/run`` planted by them, pointing at
    a directory of the victim's) must not become the memory tier: they could repoint it
    between the checks and the use."""
    sticky = tmp_path / "shm"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = sticky / "run"
    os.symlink(mine, link)
    os.lchown(link, 65534, 65534)  # nobody's
    model = torch.nn.Linear(2, 2)
    ck = unickpt.UnifiedCheckpoint(tmp_path / "ckpt", every=1, memory_dir=link)
    with pytest.raises(InvalidArgumentError, match=r"symbolic link of another user \(uid 65534\)"):
        ck.step(1, {"model": model})
    assert not any(p.name.startswith("step-") for p in mine.rglob("*"))  # nothing written through it
    ck.close(final_save=False)
    # the user's own link is their choice: it works
    own = tmp_path / "own"
    os.symlink(mine, own)
    ck = unickpt.UnifiedCheckpoint(tmp_path / "ckpt2", every=1, memory_dir=own)
    ck.step(1, {"model": model})
    ck.close()
    assert unickpt.latest(tmp_path / "ckpt2").endswith("step-00000001")


# -- F2: a listing that never ends -----------------------------------------------------------


class _EndlessLister(LoopbackServer):
    """An S3 endpoint whose ListObjectsV2 answers page after page of 1,000 keys, each page
    truncated with a next token, for ever; any other request gets 404. Counts the pages."""

    PAGE = 1000

    def __init__(self) -> None:
        self.pages = 0
        super().__init__()

    def handle(self, c: socket.socket) -> None:
        buf = b""
        try:
            c.settimeout(30)
            while True:
                while b"\r\n\r\n" not in buf:
                    got = c.recv(65536)
                    if not got:
                        return
                    buf += got
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode(errors="replace").split("\r\n")
                length = next((int(v.split(":", 1)[1]) for v in lines if v.lower().startswith("content-length:")), 0)
                while len(buf) < length:
                    buf += c.recv(65536)
                buf = buf[length:]
                method, target = lines[0].split(" ")[:2]
                if method == "GET" and "list-type=2" in target:
                    self.pages += 1
                    n = self.pages
                    keys = "".join(f"<Contents><Key>run/k{n}-{i}</Key><LastModified>2026-01-01T00:00:00.000Z"
                                   f"</LastModified><ETag>\"e\"</ETag><Size>1</Size><StorageClass>STANDARD"
                                   "</StorageClass></Contents>" for i in range(self.PAGE))
                    body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/'
                            f'doc/2006-03-01/"><Name>bucket</Name><Prefix>run/</Prefix><KeyCount>{self.PAGE}</KeyCount>'
                            f"<MaxKeys>{self.PAGE}</MaxKeys><IsTruncated>true</IsTruncated><NextContinuationToken>t{n}"
                            f"</NextContinuationToken>{keys}</ListBucketResult>").encode()
                    status = b"200 OK"
                else:
                    body = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code></Error>'
                    status = b"404 Not Found"
                c.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + (b"" if method == "HEAD" else body))
        except OSError:
            pass
        finally:
            c.close()


# the trickling server's call (tests/test_trust_round2.py), with a smaller object bound
_LIST_CALL = "import unickpt.io.objstore.clients as o\no.LIST_MAX = 20_000\n" + _TRICKLE_CALL


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_listing_that_never_ends_fails_typed_within_its_object_bound(client):
    """``latest`` over a server that pages for ever: a StorageError naming the URL after at
    most LIST_MAX objects (counted in pages served, not seconds); memory stays bounded."""
    server = _EndlessLister()
    env = dict(os.environ)
    apply_env({**offline_env(server.url, env), "UNICKPT_OBJECT_TIMEOUT_S": "20"}, env)
    try:
        r = subprocess.run([sys.executable, "-c", _LIST_CALL, client], env=env, capture_output=True, text=True,
                           timeout=HANG_GUARD_S)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["type"] == "StorageError" and "s3://bucket/run" in got["message"], (got, r.stderr[-2000:])
        assert "20000 objects" in got["message"], got
        assert 1 <= server.pages <= 20_000 // _EndlessLister.PAGE + 2, server.pages
    finally:
        server.close()


# -- F3, F6, F8: the error budget's count and the codecs' scales, as an attacker writes them -----


def _o1_checkpoint(root, generations=0):
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 64)).sum().backward()
    o.step()
    opts = unickpt.SaveOptions(compression=unickpt.Compression(quant="O1"), lossy_generations=generations)
    unickpt.save({"model": m, "optim": o}, root / "step-00000001", options=opts)
    return m, o, root / "step-00000001"


def _edit_manifest(path, fn):
    from tests.crafted import seal

    man = path / "unickpt.json"
    obj = json.loads(man.read_bytes())
    fn(obj)
    man.write_bytes(seal(obj))


def test_the_lossy_generations_count_is_bounded_at_save():
    """A count whose next value a manifest cannot hold is refused when the options are built,
    naming the bound (it was accepted, and the checkpoint then failed to load)."""
    with pytest.raises(InvalidArgumentError, match=r"lossy_generations must be below 2147483647"):
        unickpt.SaveOptions(lossy_generations=(1 << 31) - 1)
    assert unickpt.SaveOptions(lossy_generations=(1 << 31) - 2).lossy_generations == (1 << 31) - 2


def test_a_manifest_cannot_reset_the_error_budget_below_its_tensors_count(tmp_path):
    _, _, path = _o1_checkpoint(tmp_path, generations=6)
    _edit_manifest(path, lambda o: o["compression"].__setitem__("lossy_generations", 0))
    assert unickpt.read_manifest(path)[1].lossy_generations == 7  # the tensors' count, not the record's 0
    m, o, _ = _o1_checkpoint(tmp_path / "b")
    res = unickpt.load({"model": m, "optim": o}, path)
    assert res.lossy_generations == 7


@pytest.mark.parametrize("field,value", [("rel_l2", -1.0), ("max_abs", -0.5)])
def test_a_negative_error_record_is_refused(tmp_path, field, value):
    from unickpt.errors import FormatError

    _, _, path = _o1_checkpoint(tmp_path)

    def bad(o):
        for t in o["tensors"]["optim"].values():
            if "codec_args" in t and "error" in t["codec_args"]:
                t["codec_args"]["error"][field] = value

    _edit_manifest(path, bad)
    with pytest.raises(FormatError, match=rf"{field} >= 0"):
        unickpt.read_manifest(path)


@pytest.mark.parametrize("tensor,value", [("state.weight.exp_avg", float("nan")), ("state.weight.exp_avg", -1.0),
                                          ("state.weight.exp_avg_sq", float("inf")), ("state.weight.exp_avg_sq", 0.0)])
def test_crafted_scales_with_valid_checksums_are_refused_naming_the_tensor(tmp_path, tensor, value):
    """An attacker rewrites a group's scale (m: absmax; v: the w range) and its checksum: the
    load refuses values no encoder writes (NaN, negative, w below eps) instead of returning
    moments that blow up Adam's update, naming the file and the tensor."""
    import struct

    import xxhash

    from unickpt.errors import FormatError

    m, o, path = _o1_checkpoint(tmp_path)
    man = json.loads((path / "unickpt.json").read_bytes())
    entry = man["tensors"]["optim"][tensor]
    part = entry["parts"]["scales"]
    f = path / entry["file"]
    blob = bytearray(f.read_bytes())
    base = 8 + struct.unpack("<Q", blob[:8])[0] + part["offsets"][0]
    blob[base:base + 4] = struct.pack("<f", value)
    f.write_bytes(bytes(blob))
    scales = bytes(blob[base:8 + struct.unpack("<Q", blob[:8])[0] + part["offsets"][1]])
    _edit_manifest(path, lambda obj: obj["tensors"]["optim"][tensor]["parts"]["scales"].__setitem__(
        "checksums", [[0, len(scales), xxhash.xxh3_64_hexdigest(scales)]]))
    with pytest.raises(FormatError, match=rf"{entry['file']}: tensor optim/{tensor}: codec q8_\w+: a group's"):
        unickpt.load({"model": m, "optim": o}, path)
