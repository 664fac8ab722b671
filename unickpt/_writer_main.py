"""Entry point of an asynchronous writer process (see :mod:`unickpt.async_save`).

The trainer starts it with :mod:`subprocess` as a fresh interpreter::

    python -c "<BOOT>" '<config as JSON>'

so nothing of the trainer's ``__main__`` is imported or run (``multiprocessing``'s spawn
re-runs the main script in the child: a torchrun script without an
``if __name__ == "__main__":`` guard then joined the job a second time). :data:`BOOT`
sets ``sys.path`` to the trainer's (the writer imports the same ``unickpt`` and ``torch``
the trainer does, wherever they come from) before importing this module, then calls
:func:`main` with the config:

* ``conn_fd``: this end of a socket pair inherited from the trainer, wrapped in a
  :class:`multiprocessing.connection.Connection` (the object ``multiprocessing.Pipe()``
  makes of the same socket pair; ``send_bytes``/``recv_bytes``/``poll``, same framing);
* ``sentinel_fd``: the write end of a pipe that only this process holds: the trainer's
  read end becomes readable when this process exits, whatever kills it (the trainer's
  liveness check, as ``multiprocessing.Process.sentinel``);
* ``target``: ``"module:function"`` of the writer loop (``unickpt.async_save.writer:main``;
  a test may substitute one, resolved by name as ``multiprocessing`` resolves a target);
* ``args``: its arguments after the connection (rank, world, address, port, timeout,
  parent pid, node, the write end of its "joined" pipe, the group's gate name).
"""

from __future__ import annotations

import importlib
import os
from multiprocessing.connection import Connection

__all__ = ["BOOT", "main"]

#: the ``-c`` program: the trainer's import path first, then this module
BOOT = (
    "import json, sys; cfg = json.loads(sys.argv[1]); sys.path[:] = cfg['sys_path']; "
    "from unickpt._writer_main import main; main(cfg)"
)


def main(cfg: dict) -> None:
    conn_fd, sentinel_fd = int(cfg["conn_fd"]), int(cfg["sentinel_fd"])
    for fd in (conn_fd, sentinel_fd):  # ours alone: a process we might start must not hold them
        os.set_inheritable(fd, False)
    module, _, qualname = str(cfg["target"]).partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    conn = Connection(conn_fd)
    try:
        fn(conn, *cfg["args"])
    finally:
        conn.close()
    # the sentinel closes with the process
