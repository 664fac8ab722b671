"""Asynchronous save: the caller only copies its state into shared memory.

Per rank, one :class:`Checkpointer` owns

* a **staging buffer**: a shared-memory segment (``/dev/shm/unickpt-stage-<pid>-<token>``, :mod:`unickpt.shm`) allocated
  once and reused, grown when the state grows; registered as pinned memory with CUDA
  (``cudaHostRegister``) when CUDA is available, so device-to-host copies run at full speed;
* a **persistent writer process** (started on first use as a fresh interpreter running
  :mod:`unickpt._writer_main`: the trainer's ``__main__`` is never imported in it, so
  scripts need no ``if __name__ == "__main__":`` guard) that maps the segment and runs the
  ordinary synchronous save from it, on **its own gloo process group** with the other ranks'
  writers (the trainer's group is never used from the background). It blocks on its pipe
  while idle and dies with its parent (a watchdog thread notices the parent's death).

A save is committed by the writers' group exactly as a synchronous save is: visible only
once every rank's data is durable. If a writer fails or is killed, every other writer's
collective fails (gloo sees the closed connection; ``timeout_s`` bounds the rest: a hung
writer fails the others within it, see :mod:`unickpt.transport`), nothing is
committed, and every rank raises :class:`~unickpt.errors.AsyncSaveError` at its next
``save()`` or ``wait()``; the writers are then restarted on the next save.

With ``background_staging`` the staging streams: the trainer sends the save's command first,
then copies its state into the segment in segment order and tells the writer how far it has
got every ~32 MiB (``{"op": "staged"}`` messages, the last with ``done``; ``{"op": "abort"}``
if the copy fails). The writer plans, creates its files and writes what has arrived while the
rest is copied: every read of an entry's bytes waits for them (the writer's staging gate,
bounded by the save's timeout), and the save commits only after the whole copy has arrived on
every rank. Staging in the call copies first and then sends the command (followed by
``done``): there the caller waits for the copy, and a writer working beside it slows the copy
about as much as it shortens the durable time (docs/async.md).

Back-pressure: a save first waits for the previous one (one staging buffer: extra host
memory = the local state's size + the writer's bounded buckets).

Commands travel as JSON over a pipe (the options as :meth:`SaveOptions.to_json`), checked
field by field on arrival; tensors only through the shared segment. Nothing is pickled. With
a ``progress`` callback the writer also sends ``{"op": "progress"}`` reports over the pipe
(at most ~10 a second, then the final one, from a thread of its own, so a trainer that does
not read them never stalls the save); the callback runs, for each report in order, in the
trainer's thread that polls the handle.

One idea per module:

* :mod:`.segment`: the shared-memory staging segment and its size;
* :mod:`.staging`: the trainer's copy into it (where each entry sits, device streams, chunks told);
* :mod:`.protocol`: the messages between a trainer and its writer, typed and checked;
* :mod:`.handle`: :class:`AsyncSave`, the handle of one save;
* :mod:`.rendezvous`: how the writers of a group meet;
* :mod:`.lifecycle`: the writer process as its trainer starts, awaits and stops it;
* :mod:`.client`: :class:`Checkpointer` (the trainer's side of a save) and the per-group registry;
* :mod:`.writer`: what runs in the writer process.

This package uses the save pipeline (:mod:`unickpt.saving`); the pipeline never imports it.
Its surface for the rest of unickpt: :class:`AsyncSave`, :class:`Checkpointer`,
:func:`checkpointer` and :func:`shutdown`; :func:`writer_path` (:mod:`unickpt.api`),
:func:`staging_bytes` and :func:`sweep_segments` (:mod:`unickpt.manager`).
"""

from .client import Checkpointer, checkpointer, shutdown
from .handle import AsyncSave
from .protocol import writer_path
from .segment import staging_bytes, sweep_segments

__all__ = ["AsyncSave", "Checkpointer", "checkpointer", "shutdown", "staging_bytes", "sweep_segments", "writer_path"]
