"""Load: ``find -> match -> read -> verify -> apply`` (:mod:`.pipeline`).

Every rank reads only the runs of each stored tensor that its target layout covers, with
positional reads straight into the target's memory (or through a bounded window when runs
are small, e.g. column blocks). Targets are matched to the manifest before a single tensor
byte is read, so a mismatch never half-fills a state dict.

Modules: :mod:`.options` (what a load is asked and what it did), :mod:`.locate` (which
checkpoint, its manifest), :mod:`.target` (the target matched to it), :mod:`.files` (the
files, opened safely), :mod:`.session` (one rank's reads, :class:`ReadSession`),
:mod:`.coded` (coded tensors decoded), :mod:`.verify` (checksums), :mod:`.pipeline` (the
stages).
"""

from .locate import read_manifest
from .options import LoadOptions, LoadResult, Verify
from .pipeline import load

__all__ = ["LoadOptions", "LoadResult", "Verify", "load", "read_manifest"]
