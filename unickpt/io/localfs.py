"""Local files the library opens by name: only regular files, opened without blocking and
without following a symbolic link; small files written by rename inside their directory,
never through a link; directories that must belong to this user.

Every read of a file by name goes through :func:`open_regular` (checkpoint files, owner
records, ``config.json`` given to ``export``, DCP metadata): a FIFO, socket or device is
refused as "not a regular file" at once (``O_NONBLOCK``, then ``fstat``), never waited on.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid

from ..errors import CheckpointNotFoundError, FormatError, InvalidArgumentError, StorageError


__all__ = ["open_regular", "read_regular", "replace_file", "check_private_dir"]

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO"...)."""
    return next((k for test, k in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, *, follow: bool = False) -> tuple[int, os.stat_result]:
    """``(fd, stat)`` of ``path`` opened read-only, only if it is a regular file reached without
    following a symbolic link; never blocks (FIFOs, devices). Typed errors name the path.
    ``follow``: a path the user named outright (``--config``) may itself be a link, their
    choice, as a Hugging Face cache's files are; what it leads to must still be a regular file."""
    try:
        fd = os.open(path, _READ_FLAGS & ~getattr(os, "O_NOFOLLOW", 0) if follow else _READ_FLAGS)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FormatError(f"{path}: is a symbolic link (or a loop of them); checkpoint files must be regular "
                              "files inside the checkpoint directory") from None
        if e.errno == errno.ENOTDIR:
            raise CheckpointNotFoundError(f"{path}: a component of the path is not a directory") from None
        if e.errno == errno.ENXIO:  # a socket, or a FIFO without writer on some systems
            raise FormatError(f"{path}: is not a regular file") from None
        raise StorageError(e.errno, e.strerror, path) from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise StorageError(e.errno, e.strerror, path) from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{path}: is {kind_of(st.st_mode)}, not a regular file")
    return fd, st


def read_regular(path: str, limit: int, *, follow: bool = False) -> bytes:
    """The content of regular file ``path`` (:func:`open_regular`), at most ``limit`` bytes
    (:class:`~unickpt.errors.FormatError` beyond)."""
    fd, st = open_regular(path, follow=follow)
    try:
        if st.st_size > limit:
            raise FormatError(f"{path}: {st.st_size} bytes, larger than the {limit} bytes allowed for this file")
        chunks, n = [], 0
        while n <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
    except OSError as e:
        raise StorageError(e.errno, e.strerror or str(e), path) from None
    finally:
        os.close(fd)
    if n > limit:
        raise FormatError(f"{path}: larger than the {limit} bytes allowed for this file")
    return b"".join(chunks)


def read_json_record(path: str, limit: int = 1 << 16) -> dict | None:
    """A small JSON object the library wrote (an owner record), or None when there is none,
    it is not a regular file, or it does not parse: callers treat all three as "no record"."""
    try:
        rec = json.loads(read_regular(path, limit))
    except (OSError, ValueError, RecursionError, FormatError, CheckpointNotFoundError, StorageError):
        return None
    return rec if isinstance(rec, dict) else None


def replace_file(directory: str, name: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``directory/name`` as a new file with ``data``, atomically and without following
    a link: a temporary created exclusively inside the directory (opened by a descriptor that
    was reached without following links), fsynced, then renamed over ``name`` (a link planted
    there is replaced, never written through)."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow | getattr(os, "O_CLOEXEC", 0))
    try:
        tmp = f".{name}.{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow | getattr(os, "O_CLOEXEC", 0), mode,
                     dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def check_private_dir(path: str, what: str) -> os.stat_result | None:
    """Refuse (:class:`~unickpt.errors.InvalidArgumentError`, naming ``what`` and the path) a
    directory another user could put files into or take files out of: a symbolic link, one
    owned by another user, or one writable by its group or others without the sticky bit.
    None when ``path`` does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(e.errno, e.strerror, path) from None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidArgumentError(f"{path}: the {what} is a symbolic link; give the real path")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"{path}: the {what} is {kind_of(st.st_mode)}, not a directory")
    if st.st_uid != os.geteuid():
        raise InvalidArgumentError(f"{path}: the {what} belongs to another user (uid {st.st_uid}; this process runs "
                                   f"as uid {os.geteuid()}): it could hold snapshots planted by them; use a directory "
                                   "of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise InvalidArgumentError(f"{path}: the {what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, "
                                   "no sticky bit): they could plant or replace snapshots; chmod go-w it")
    _check_links(path, what)
    _check_ancestors(path, what)
    return st


def _check_links(path: str, what: str) -> None:
    """The path as given, component by component: a symbolic link on the way must belong to
    root or this user (the user's own choice), or its owner could point it elsewhere between
    a check and a use, and :func:`_check_ancestors` would have checked where it pointed then."""
    me = os.geteuid()
    todo = os.path.abspath(path).split(os.sep)[1:]
    cur, hops = os.sep, 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        nxt = os.path.dirname(cur) if part == ".." else os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return  # (created later under checked parents)
        except OSError as e:
            raise StorageError(e.errno, e.strerror, nxt) from None
        if not stat.S_ISLNK(st.st_mode):
            cur = nxt
            continue
        if st.st_uid not in (0, me):
            raise InvalidArgumentError(
                f"{path}: the {what} is reached through {nxt}, a symbolic link of another user (uid {st.st_uid}): they "
                "could point it at any directory of yours; give the real path")
        hops += 1
        if hops > 40:
            raise InvalidArgumentError(f"{path}: the {what} is reached through too many symbolic links")
        target = os.readlink(nxt)
        todo = [x for x in target.split(os.sep) if x] + todo
        cur = os.sep if os.path.isabs(target) else cur


def _check_ancestors(path: str, what: str) -> None:
    """Every directory above ``path`` (links resolved: the user's own choice) must keep other
    users from replacing the entry below it: owned by root or this user, and not writable by
    others unless sticky (``/dev/shm``, ``/tmp``). A parent another user controls could swap
    the directory for a link to anything between a check and its use."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    me = os.geteuid()
    while True:
        try:
            st = os.stat(parent)
        except OSError as e:
            raise StorageError(e.errno, e.strerror, parent) from None
        if st.st_uid not in (0, me):
            raise InvalidArgumentError(
                f"{path}: the {what} lies in {parent}, which belongs to another user (uid {st.st_uid}): they could "
                "replace it with a link to any directory of yours; use a directory whose parents are yours or root's")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise InvalidArgumentError(
                f"{path}: the {what} lies in {parent}, which other users may write (mode {stat.S_IMODE(st.st_mode):o}, "
                "no sticky bit): they could replace it with a link; chmod go-w it or use another directory")
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def owned_by_me(path: str) -> bool:
    """``path`` (not followed) belongs to this process's user."""
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except OSError:
        return False
