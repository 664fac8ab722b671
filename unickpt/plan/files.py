"""The plan's files (one per role and writer, split by size, headers computed up front) and the
cut of each writer's byte stream into buckets."""

from __future__ import annotations

from ..format import order_key
from ..io.fileset import file_name, pack, split_by_size
from .model import FilePlan, Segment, TensorPlan


def make_files(tensors, world, nodes, max_file_bytes) -> list[FilePlan]:
    by_role: dict[str, list[list[TensorPlan]]] = {}
    writers_of: dict[str, list[int]] = {}
    grouped: dict[str, dict[int, list[TensorPlan]]] = {}
    for t in tensors.values():
        grouped.setdefault(t.role, {}).setdefault(t.writer, []).append(t)
    for role in sorted(grouped):
        parts: list[list[TensorPlan]] = []
        owners: list[int] = []
        for w in sorted(grouped[role]):
            mine = sorted(grouped[role][w], key=lambda t: order_key(t.dtype, t.name))
            for part in split_by_size(mine, lambda t: t.nbytes, max_file_bytes):
                parts.append(part)
                owners.append(w)
        by_role[role] = parts
        writers_of[role] = owners
    files: list[FilePlan] = []
    for role, parts in by_role.items():
        n = len(parts)
        for i, (part, w) in enumerate(zip(parts, writers_of[role]), start=1):
            name = file_name(role, i, n)
            header, stored = pack(((key, dt, sh, (t, p)) for t in part for p, key, dt, sh in t.stored()),
                                     {"format": "pt", "unickpt_role": role})
            for key, dt, sh, (t, p), info in stored:
                t.file = name
                if t.quantized:
                    t.parts[p] = (key, dt, sh, info.begin, info.end)
                else:
                    t.begin, t.end = info.begin, info.end
            for t in part:
                if t.quantized:  # the span of its parts (ordering only: parts are read by offset)
                    t.begin = min(x[3] for x in t.parts.values())
                    t.end = max(x[4] for x in t.parts.values())
            files.append(FilePlan(name, role, w, nodes[w], part, header))
    return files


def make_chunks(files: list[FilePlan], world: int, bucket_bytes: int) -> dict[int, list[list[Segment]]]:
    chunks: dict[int, list[list[Segment]]] = {}
    by_writer: dict[int, list[tuple[int, FilePlan]]] = {}
    for fi, f in enumerate(files):
        by_writer.setdefault(f.writer, []).append((fi, f))
    for w in sorted(by_writer):
        out: list[list[Segment]] = []
        cur: list[Segment] = []
        room = bucket_bytes
        for fi, f in by_writer[w]:
            for t in f.tensors:
                if t.direct:
                    continue
                start, n, isz = 0, t.numel, t.itemsize
                g = t.codec["group"] if t.quantized else 1  # quantized: whole groups per segment
                while start < n or (n == 0 and start == 0):
                    take = min(n - start, max(room // isz, 0) // g * g)
                    if take == 0 and n > 0:
                        out.append(cur)
                        cur, room = [], bucket_bytes
                        take = min(n - start, max(bucket_bytes // isz // g * g, g))
                    cur.append(Segment(t, fi, start, start + take))
                    room -= take * isz
                    start += take
                    if n == 0:
                        break
        if cur:
            out.append(cur)
        if out:
            chunks[w] = out
    return chunks

