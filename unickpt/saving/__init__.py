"""Save: ``plan -> open -> write -> commit`` (:mod:`.pipeline`).

Every rank flattens its state dict, the ranks agree on a routing table (plan), pieces travel
to their writer in bounded buckets, writers stream whole tensors into safetensors files in
a temporary directory (fsynced, checksummed), and rank 0 commits: manifest last, then an
atomic rename. Any failure on any rank surfaces on every rank and nothing becomes visible.

:func:`save_entries` is the pipeline, run by the caller (synchronous ``unickpt.save``) or by
an asynchronous writer process (:mod:`unickpt.async_save`); :class:`SaveOptions` is every
option it takes, checked once. The public ``unickpt.save`` lives in :mod:`unickpt.api`, which
picks between the two: this package imports neither.

Modules: :mod:`.options` (what a save is asked and what it did), :mod:`.checks` (what it
refuses before writing), :mod:`.writer` (one rank's share of the files),
:mod:`.to_manifest` (the ranks' reports as the manifest), :mod:`.pipeline` (the stages).
"""

from .options import DEFAULT_BUCKET, ProgressFn, SaveOptions, SaveResult
from .pipeline import save_entries
from .writer import StagedBytes

__all__ = ["DEFAULT_BUCKET", "ProgressFn", "SaveOptions", "SaveResult", "StagedBytes", "save_entries"]
