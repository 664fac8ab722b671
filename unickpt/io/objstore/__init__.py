"""Object stores: the :class:`~unickpt.io.storage.Storage` interface over fsspec URLs and S3.

Paths are URLs (``s3://bucket/prefix/step-00000100``, ``memory://ckpt``); a "directory" is a
key prefix. What an object store cannot do (rename a directory, let several ranks write one
object) is declared in :attr:`ObjectStorage.caps`; the planner and the write transaction
(:mod:`unickpt.io.commit`) read those and use a commit marker written last instead of a
rename, and one writer per object (nor can it lock: :meth:`ObjectStorage.lock` does nothing).

Three clients sit behind one small :class:`_Client` interface:

* ``obstore`` (the default for ``s3://``; Rust ``object_store``): parallel multipart uploads
  from memory, concurrent ranged reads, conditional puts;
* ``s3fs`` (fsspec's S3 file system): the same, with parts uploaded by a thread pool;
* any other fsspec file system (``memory://``, ``gs://``, ``az://``, ``file://``...): ranged
  reads through ``cat_ranges``, writes streamed in order.

Data are sent from and read into memory: nothing is staged in a local temporary file.
"""

from .clients import check_options, parse_options
from .objects import ObjectStorage, object_storage

__all__ = ["ObjectStorage", "check_options", "object_storage", "parse_options"]
