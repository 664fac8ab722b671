"""Crafted torch.distributed.checkpoint ``.metadata`` files, for tests/test_dcp_safety.py.

Every payload is harmless: if a plain ``pickle.load`` runs it, it creates (or tries to
read) a marker file and nothing else. The tests regenerate them with the marker inside their
``tmp_path`` (:func:`payloads`); ``python tests/attacks/dcp/make.py`` rewrites the recorded
copies next to this script, whose marker is the relative path :data:`MARKER_NAME` (a file
created in the current directory, should anything ever unpickle them unrestricted).

Each recorded file is meant to be copied to ``SOMEDIR/.metadata``.
"""

from __future__ import annotations

import os
import pickle
import shlex
import struct
import sys

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

MARKER_NAME = "unickpt_dcp_attack_marker"
HERE = os.path.dirname(os.path.abspath(__file__))


def _str(s: str) -> bytes:
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) + b) if len(b) < 256 else (b"X" + struct.pack("<I", len(b)) + b)


def _args(args: tuple) -> bytes:
    """Opcodes pushing tuple ``args`` (protocol 2: no framing, fits in any protocol-4 stream)."""
    return pickle.dumps(args, protocol=2)[2:-1]


def call(module: str, name: str, *args) -> bytes:
    """A protocol-4 pickle (as DCP writes) that calls ``module.name(*args)`` when loaded."""
    return b"\x80\x04" + _str(module) + _str(name) + b"\x93" + _args(args) + b"R."


def metadata(relative_path: str = "__0_0.distcp", planner_data=None) -> Metadata:
    """A small, well-formed DCP Metadata (one float32 tensor ``w`` of 2 elements)."""
    return Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([2]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])},
        storage_data={MetadataIndex("w", [0], 0): _StorageInfo(relative_path, 0, 10)},
        planner_data={"w": ("w",)} if planner_data is None else planner_data,
        storage_meta=StorageMeta(checkpoint_id="x", save_id="s"),
        version="1.0.0",
    )


class _Reduce:
    """Pickles as ``fn(*args)``: pickle records ``fn`` under its own module (os.system -> posix)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payloads(marker: str) -> dict[str, bytes]:
    """``name -> .metadata bytes``. The code-running ones would create ``marker``."""
    touch = f"touch {shlex.quote(marker)}"
    write = f"open({marker!r}, 'w').write('pwned')"
    good = pickle.dumps(metadata(), protocol=4)
    return {
        # code execution through a global, at top level
        "os_system": call("os", "system", touch),
        "builtins_exec": call("builtins", "exec", write),
        "builtins_eval": call("builtins", "eval", write),
        "subprocess_popen": call("subprocess", "Popen", ["touch", marker]),
        "torch_load": call("torch", "load", marker),
        "torch_rebuild_tensor_v2": call("torch._utils", "_rebuild_tensor_v2", 0, 0, (2,), (1,), False, None),
        # a dotted name resolved from an allowed module (metadata.py imports os)
        "dotted_os_system": call("torch.distributed.checkpoint.metadata", "os.system", touch),
        # pickle.loads of an inner payload, reached through DCP's own module
        "dotted_pickle_loads": call("torch.distributed.checkpoint.filesystem", "pickle.loads",
                                    call("builtins", "exec", write)),
        # a real-looking Metadata carrying the call in planner_data (pickled as posix.system)
        "nested_posix_system": pickle.dumps(metadata(planner_data={"w": _Reduce(os.system, touch)}), protocol=4),
        # malformed
        "persistent_id": b"\x80\x04" + _str("x") + b"Q.",
        "truncated": good[: len(good) // 2],
        "garbage": b"this is not a pickle\n" * 4,
        "empty": b"",
        "plain_dict": pickle.dumps({"state_dict_metadata": {}, "storage_data": {}}, protocol=4),
        "deep_list": b"\x80\x04" + b"]" * 10_000 + b"a" * 9_999 + b".",
        # well-formed pickles of allowed classes with hostile storage paths
        "relative_path_parent": pickle.dumps(metadata("../x"), protocol=4),
        "relative_path_absolute": pickle.dumps(metadata("/etc/passwd"), protocol=4),
        "relative_path_subdir": pickle.dumps(metadata("sub/x"), protocol=4),
        "relative_path_hidden": pickle.dumps(metadata(".metadata"), protocol=4),
        "relative_path_nul": pickle.dumps(metadata("x\0y"), protocol=4),
        "relative_path_backslash": pickle.dumps(metadata("..\\x"), protocol=4),
    }


def main(argv: list[str] | None = None) -> int:
    out = (argv or sys.argv[1:] or [HERE])[0]
    for name, data in sorted(payloads(MARKER_NAME).items()):
        with open(os.path.join(out, f"{name}.metadata"), "wb") as f:
            f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
