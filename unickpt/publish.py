"""Live weight updates: a trainer publishes versions of its model; inference jobs keep a model
resident and update it in place (docs/serving.md).

A **version** is an ordinary committed checkpoint ``step-N`` of the model role under the
publish directory, written by :func:`publish` (``UnifiedCheckpoint(publish_dir=...)`` calls it
every ``publish_every`` steps): a version appears whole or not at all (the save's atomic
commit), so a reader never sees a torn one.

A **reader lease** keeps a version from being retired while it is read: before reading
version N, each rank of a :class:`WeightSubscriber` writes a lease file (its owner record:
host, pid, start time) under ``.leases/``, then checks that N is still committed. On a file
system it does both under the directory's commit lock, and :func:`publish` retires old
versions under the same lock, skipping every version a live lease names. On an object store
(no lock) the order does it: the publisher deletes a version's manifest (its commit marker)
first and lists the leases after, so a reader that found the manifest wrote its lease before
that listing, which sees it; the version's files then stay until its leases are gone
(removed by a later publish's sweep), and a reader that finds no manifest drops its lease
and looks again. A lease is live while its process runs (this host) or for
:data:`LEASE_STALE_S` after it was last written (another host); the reader rewrites it every
quarter of that while its load runs, so a long load keeps its version and a reader killed
mid-read holds nothing back for long.

A subscriber loads into the model's own tensors (no reallocation), through a
:class:`~unickpt.Mapping` when its layout differs from the trainer's. If an update fails
(a rank killed, a damaged byte), the model holds part of the new version: ``version``
becomes None and the next :meth:`WeightSubscriber.update` loads a whole version again;
serve only after an update returned.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Mapping

import torch

from . import errors
from ._metrics import log
from .io.catalog import committed_steps
from .io.commit import new_token
from .io.leases import LEASE_STALE_S, LEASES
from .io.storage import storage_for

__all__ = ["publish", "WeightSubscriber", "LEASE_STALE_S", "LEASES", "retire_unleased"]


def _publish_storage(publish_dir, storage_options):
    """The storage of a publish directory: a file system with its commit lock, or an object
    store (leases ordered by the manifest, module doc)."""
    storage, root = storage_for(publish_dir, storage_options)
    if storage.caps.atomic_rename and not hasattr(storage, "lock"):
        raise errors.NotSupportedError(f"{os.fspath(publish_dir)}: publishing on a file system needs its commit lock")
    if storage.caps.process_local:
        raise errors.NotSupportedError(f"{os.fspath(publish_dir)}: memory:// lives in one process; a publish directory "
                                       "is for other jobs (a file system or an object store)")
    return storage, root


def _model_state(model: Any) -> Mapping[str, Any]:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if isinstance(model, Mapping):
        return model
    raise errors.InvalidArgumentError(f"a model (torch.nn.Module) or its state dict expected, got {type(model).__name__}")


def publish(model: Any, publish_dir: str | os.PathLike, version: int, *, dtype: torch.dtype | None = None,
            keep: int = 2, group: Any = None, storage_options: Mapping[str, Any] | None = None,
            timeout_s: float | None = None):
    """Publish ``model`` (a module or its state dict; DTensors and :func:`unickpt.shard`
    tensors as any save takes them) as version ``version`` (collective): the model role,
    floating tensors cast to ``dtype``, committed as ``step-{version}`` under ``publish_dir``;
    then every version older than the newest ``keep`` that no live reader leases is retired.
    Returns the :class:`~unickpt.SaveResult`."""
    from .api import save
    from .saving import SaveOptions

    if type(version) is not int or version < 0:
        raise errors.InvalidArgumentError(f"version must be an integer >= 0, got {version!r}")
    if type(keep) is not int or keep < 1:
        raise errors.InvalidArgumentError(f"keep must be an integer of at least 1, got {keep!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise errors.InvalidArgumentError(f"dtype must be a floating torch dtype or None, got {dtype!r}")
    storage, root = _publish_storage(publish_dir, storage_options)
    from .transport import Comm

    steps = committed_steps(storage, root)
    err = None
    if steps and version < steps[-1][0]:  # (retention would retire it at once; subscribers wait for newer)
        err = errors.NewerVersionError(
            f"{os.fspath(publish_dir)}: version {version} is older than the newest published version {steps[-1][0]}: "
            "subscribers only take newer versions. Resume the run (its steps continue), or publish to a fresh "
            "publish_dir")
    Comm(group, timeout_s=timeout_s).agree(err, "publish (newer than the published versions)")
    state = {k: (v.to(dtype) if dtype is not None and isinstance(v, torch.Tensor) and v.is_floating_point() else v)
             for k, v in _model_state(model).items()}
    res = save({"model": state}, storage.join(root, f"step-{version:08d}"), group=group, step=version,
               options=SaveOptions(storage_options=storage_options, timeout_s=timeout_s))

    if Comm(group, timeout_s=timeout_s).rank == 0:  # (group="local" too: this process alone)
        retired = retire_unleased(storage, root, keep, timeout_s)
        if retired:
            log.info("published version %d to %s; retired %s", version, root, ", ".join(retired))
    return res


def retire_unleased(storage, root: str, keep: int, timeout_s: float | None = None) -> list[str]:
    """Retire the versions older than the newest ``keep`` that no live lease names
    (:func:`unickpt.io.commit.retain`, which checks leases under the directory's commit lock:
    a reader's lease is either seen there or finds its version gone; leases of readers that
    are gone are cleared as it retires). Returns the retired paths."""
    from .io.commit import retain, sweep_stale

    out = retain(storage, root, keep, timeout_s=timeout_s)  # (it clears dead readers' leases as it retires)
    # what a killed publish left (its owner is gone), and on object stores the files of
    # versions retired while leased, once the leases are gone
    sweep_stale(storage, root, timeout_s=timeout_s)
    if not storage.caps.atomic_rename:  # (under a file system's lock, retain cleared them)
        from .io.leases import leased_steps

        leased_steps(storage, root, clear=True)
    return out


class WeightSubscriber:
    """An inference job's view of a publish directory (module doc). ``mapping``: the
    :class:`~unickpt.Mapping` from the trainer's names and layout to the model's; ``group``:
    the inference job's process group (every rank calls :meth:`update`)."""

    def __init__(self, publish_dir: str | os.PathLike, *, mapping: Any = None, group: Any = None,
                 storage_options: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                 poll_s: float = 0.05, cast: bool = False) -> None:
        from .loading import LoadOptions

        self.publish_dir = os.fspath(publish_dir)
        self.storage, self.root = _publish_storage(publish_dir, storage_options)
        self.options = LoadOptions(mapping=mapping, storage_options=storage_options, timeout_s=timeout_s)
        if not (isinstance(poll_s, (int, float)) and 0 < poll_s <= 60):
            raise errors.InvalidArgumentError(f"poll_s must be a number of seconds in (0, 60], got {poll_s!r}")
        if not isinstance(cast, bool):
            raise errors.InvalidArgumentError(f"cast must be True or False, got {cast!r}")
        self.group, self.poll_s, self.cast = group, float(poll_s), cast
        self.version: int | None = None
        """The version the model holds whole (None: none yet, or an update failed midway)."""
        self._leased: str | None = None  # the directory of the version last leased
        self.last: Any = None
        """The :class:`~unickpt.LoadResult` of the last update that loaded (bytes read,
        seconds, checksummed ranges verified)."""

    def newest(self) -> int | None:
        """The newest committed version (this rank's own look; not collective)."""
        steps = committed_steps(self.storage, self.root)
        return steps[-1][0] if steps else None

    def update(self, model: Any, *, timeout: float | None = None) -> int | None:
        """Wait (at most ``timeout`` seconds; None: the subscriber's ``timeout_s``, by default
        ``UNICKPT_TIMEOUT_S`` or 600 s) for a committed version newer than
        the one the model holds, load it into the model's tensors in place and return it;
        None when none came in time (the model unchanged). Collective over ``group``: the
        ranks agree on the version, each leases it, all load it."""
        from .loading import load
        from .transport import LOCAL, Comm

        if timeout is not None and (isinstance(timeout, bool) or not (isinstance(timeout, (int, float))
                                                                       and 0 <= timeout < float("inf"))):
            raise errors.InvalidArgumentError(f"timeout must be a finite number of seconds >= 0 or None, got {timeout!r}")
        if not isinstance(model, (torch.nn.Module, Mapping)):
            raise errors.InvalidArgumentError(f"update needs the model (a torch.nn.Module) or its state dict, got "
                                              f"{type(model).__name__}")
        if isinstance(model, Mapping) and list(model) == ["model"] and isinstance(model["model"], (Mapping,
                                                                                                  torch.nn.Module)):
            raise errors.InvalidArgumentError("update takes the model itself (a module, or the dict of its tensors), "
                                              "not {'model': ...}: a version holds the model role only")
        comm = Comm(self.group, timeout_s=self.options.timeout_s)
        deadline = time.monotonic() + (comm.timeout_s if timeout is None else timeout)
        while True:  # rank 0 decides for all: a newer version, "wait", or "no more waiting" (-2)
            code = -1
            if comm.rank == 0:
                mine = self.newest()
                if mine is not None and (self.version is None or mine > self.version):
                    code = mine
                elif time.monotonic() >= deadline:
                    code = -2
            v = comm.all_gather_int(code, "weight update (the newest version)")[0]
            if v == -2:  # (one verdict: a rank whose clock ran out first never leaves the others waiting)
                return None
            if v >= 0:
                lease = self._lease(v)
                try:
                    if all(comm.all_gather_int(int(lease is not None), "weight update (leasing the version)")):
                        self.version = None  # (until the load below has returned on every rank)
                        # each rank reads its own pieces of the version the ranks agreed on and
                        # holds a lease on (no collective inside: the load's own agreements are
                        # what cost most in an update), then one agreement: a failure anywhere
                        # raises everywhere, typed
                        err = None
                        stop = threading.Event()
                        refresher = self._refresh(lease, stop)
                        try:
                            # (the version's own directory, as the lease's listing found it)
                            self.last = load({"model": model}, self._leased, group=LOCAL, cast=self.cast,
                                             options=self.options)
                        except Exception as e:
                            err = e
                        finally:
                            stop.set()
                            if refresher is not None:
                                refresher.join()
                        comm.agree(err, "weight update (loading the version)")
                        self.version = v
                        return v
                finally:
                    self._release(lease)
                continue  # (another rank found it retired: look again)
            time.sleep(max(0.0, min(self.poll_s, deadline - time.monotonic())) if comm.rank == 0 else self.poll_s / 2)

    def _lease(self, v: int) -> str | None:
        """A lease on version ``v`` (its path), or None when ``v`` is no longer committed;
        ``self._leased`` is then the version's own directory (from the same listing)."""
        from .liveness import me

        d = self.storage.join(self.root, LEASES)
        path = self.storage.join(d, f"step-{v:08d}.{new_token()}")
        if not self.storage.caps.atomic_rename:  # an object store: the lease first, then the manifest
            self.storage.write_bytes(path, json.dumps(me()).encode())
            self._leased = dict(committed_steps(self.storage, self.root)).get(v)
            if self._leased is not None:
                return path
            self._release(path)
            return None
        if os.path.islink(d) or (os.path.lexists(d) and not os.path.isdir(d)):  # (a file system)
            raise errors.FormatError(f"{d}: not a directory of its own (a link or a file): no lease is written there")
        with self.storage.lock(self.root, self.options.timeout_s):
            self._leased = dict(committed_steps(self.storage, self.root)).get(v)
            if self._leased is None:
                return None
            self.storage.makedirs(d)
            self.storage.write_bytes(path, json.dumps(me()).encode())
        return path

    def _refresh(self, lease: str | None, stop: threading.Event) -> threading.Thread | None:
        """Rewrite ``lease`` every quarter of :data:`LEASE_STALE_S` until ``stop`` is set (a
        load longer than that keeps its version from another host's point of view)."""
        from .liveness import me

        if lease is None:
            return None

        def run() -> None:
            while not stop.wait(LEASE_STALE_S / 4):
                try:
                    self.storage.write_bytes(lease, json.dumps(me()).encode())
                except Exception as e:  # (the load goes on; a retired version fails it, typed)
                    log.warning("weight update: could not refresh the reader lease %s: %s", lease, e)

        t = threading.Thread(target=run, name="unickpt-lease", daemon=True)
        t.start()
        return t

    def _release(self, lease: str | None) -> None:
        if lease is not None:
            try:
                self.storage.remove_file(lease)
            except FileNotFoundError:
                pass
