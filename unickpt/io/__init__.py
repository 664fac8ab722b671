"""The io layer, by role: everything that touches files and objects.

* :mod:`.storage`: the protocols of a store (:class:`~.storage.Storage`: paths, namespace,
  byte reads, file writes) and :func:`~.storage.storage_for`, which routes a path or URL to
  its backend; :mod:`.capabilities` (what a backend can do, read by the planner and the
  transaction);
* backends: :mod:`.local` (POSIX: pread, O_DIRECT writes, fsync, atomic rename; files opened
  by :mod:`.localfs`: regular files only, never through links, never blocking) and
  :mod:`.objstore` (fsspec URLs and S3: multipart uploads, ranged reads, conditional puts);
* :mod:`.fileset`: the one way files are written (split by size, laid out, created, written,
  closed with their O_DIRECT fragments merged) and recorded in the manifest;
* :mod:`.files`: a checkpoint's files opened for reading, checked against the manifest;
* :mod:`.commit`: the write transaction with its two publish strategies (rename on POSIX,
  conditional-put marker on object stores), sweeping, retention;
* :mod:`.catalog`: the committed checkpoints of a root, step names, the newest one.

Save (:mod:`unickpt.saving`) and load (:mod:`unickpt.loading`) sit above this layer; nothing
here imports them.
"""
