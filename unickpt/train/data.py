"""Real text that ships with every Python: the standard library's own ``.py`` sources.

Byte-level tokens (vocab 256). The corpus is cut into windows of ``seq_len + 1`` bytes; the
last ``eval_fraction`` of windows is held out. Training order is a permutation of the
training windows drawn from ``seed`` (a new one each epoch). The **global batch is defined
globally**: step k trains on samples ``[k*B, (k+1)*B)`` of that order, whatever the
data-parallel size; each dp rank takes a contiguous share. The position (samples consumed)
is part of the checkpoint.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["TextData", "stdlib_corpus"]


def stdlib_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Bytes of the standard library's ``.py`` files, in sorted path order, up to ``max_bytes``."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests", "idlelib"))
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            with open(os.path.join(dirpath, f), "rb") as fh:
                b = fh.read()
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


@dataclass
class TextData:
    seq_len: int = 128
    seed: int = 0
    max_bytes: int = 8 << 20
    eval_fraction: float = 0.02

    def __post_init__(self) -> None:
        tokens = stdlib_corpus(self.max_bytes)
        w = self.seq_len + 1
        n = len(tokens) // w
        self.windows = torch.from_numpy(tokens[: n * w].astype(np.int64).reshape(n, w))
        n_eval = max(1, int(n * self.eval_fraction))
        self.n_train = n - n_eval
        self.eval_windows = self.windows[self.n_train :]
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = torch.randperm(self.n_train, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples ``[start, start+count)`` of the training order: (count, seq_len+1)."""
        idx = []
        for i in range(start, start + count):
            epoch, j = divmod(i, self.n_train)
            idx.append(int(self._order(epoch)[j]))
        return self.windows[idx]

    def eval_batches(self, n_samples: int, batch: int):
        n = min(n_samples, len(self.eval_windows))
        for i in range(0, n, batch):
            yield self.eval_windows[i : min(i + batch, n)]
