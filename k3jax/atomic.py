"""Atomic directory output: a directory that either appears complete or not at all (conversion, data prepare)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import socket
import uuid
from typing import Callable

log = logging.getLogger(__name__)
OWNER_FILE = ".owner"  # in a temporary directory: {"host", "pid"} of the process writing it
_LEFTOVER = re.compile(r"\.(tmp|old)-(\d+)-[0-9a-f]{8}$")


class AtomicDir:
    """`with AtomicDir(out, overwrite) as tmp:` writes into a unique temporary sibling of `out` and renames it to
    `out` on success; on any exception the temporary directory is removed and `out` is untouched. An existing `out`
    (a directory or a file) needs `overwrite` (checked on entry, and again on exit in case another writer finished
    first); the replaced one is removed.

    A writer that was killed leaves `OUT.tmp-<pid>-<hex>` (or, killed while replacing, `OUT.old-<pid>-<hex>`): the
    next writer of `OUT` removes those whose process no longer runs on this host, saying so through `log_fn`; ones
    of a live process or of another host (recorded in `.owner`) are left, with a note."""

    def __init__(self, out: str, overwrite: bool = False, log_fn: Callable[[str], None] | None = None):
        self.out = os.path.abspath(out)
        self.overwrite = overwrite
        self.log_fn = log_fn or log.warning
        self.tmp = f"{self.out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def check(self) -> None:
        if os.path.lexists(self.out) and not self.overwrite:
            raise FileExistsError(f"output {self.out} already exists (pass --overwrite to replace it)")

    def clean_stale(self) -> None:
        """Removes leftovers of killed writers of `out` (see the class docstring)."""
        for path in sorted(glob.glob(glob.escape(self.out) + ".tmp-*") + glob.glob(glob.escape(self.out) + ".old-*")):
            m = _LEFTOVER.search(path)
            if not m or path == self.tmp:
                continue
            host, pid = _owner(path, int(m.group(2)))
            if host != socket.gethostname():
                self.log_fn(f"left {path} in place: written by process {pid} on host {host} (remove it if no "
                            f"writer runs there)")
            elif _alive(pid):
                self.log_fn(f"left {path} in place: process {pid} is still running (another writer?)")
            else:
                _remove(path)
                self.log_fn(f"removed {path}: left by an interrupted run (process {pid} no longer runs)")

    def __enter__(self) -> str:
        self.check()
        self.clean_stale()
        os.makedirs(self.tmp)
        with open(os.path.join(self.tmp, OWNER_FILE), "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        os.remove(os.path.join(self.tmp, OWNER_FILE))
        old = None
        if os.path.lexists(self.out):
            if not self.overwrite:  # someone else finished first
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise FileExistsError(f"output {self.out} appeared while writing (another writer?)")
            old = f"{self.out}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old:
            _remove(old)
        return False


def _owner(path: str, pid: int) -> tuple[str, int]:
    """(host, pid) of a leftover: its `.owner` record, else this host and the pid in its name."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
        return str(owner["host"]), int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return socket.gethostname(), pid


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


def os_error(e: OSError) -> str:
    """One line for an OSError, the file and the reason: `/out/x.tmp-1-ab/params: Read-only file system`."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"
