"""The routing table: which rank writes each full tensor, into which file, and how pieces
travel there. Pure code: every rank computes the same plan from the same summaries.

Flow: each rank encodes a compact *summary* of its entries (names, dtypes, shapes, layouts:
JSON, zstd-compressed; no object graphs; :mod:`.summary`); summaries are exchanged (see
:mod:`unickpt.saving.pipeline`); then :func:`make_plan` (:mod:`.make`) assigns writers
(balancing bytes, preferring the rank that already holds most of a tensor), groups tensors
into per-role files and cuts each writer's byte stream into buckets of at most
``bucket_bytes`` (:mod:`.files`). :meth:`SavePlan.schedule` (:mod:`.model`) turns that into
the concrete sends, receives and copies of one rank, step by step.
"""

from .make import BALANCE_SLACK, DIRECT_MIN_RUN, make_plan
from .model import FilePlan, SavePlan, Segment, Step, TensorPlan, extents_of
from .summary import LocalSummary, assemble, decode_summary, encode_summary, summarize, summary_digest

__all__ = ["BALANCE_SLACK", "DIRECT_MIN_RUN", "FilePlan", "LocalSummary", "SavePlan", "Segment", "Step", "TensorPlan",
           "assemble", "decode_summary", "encode_summary", "extents_of", "make_plan", "summarize", "summary_digest"]
