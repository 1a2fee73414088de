"""Atomic directory output: a directory that either appears complete or not at all (conversion, data prepare)."""

from __future__ import annotations

import os
import shutil
import uuid


class AtomicDir:
    """`with AtomicDir(out, overwrite) as tmp:` writes into a unique temporary sibling of `out` and renames it to
    `out` on success; on any exception the temporary directory is removed and `out` is untouched. An existing `out`
    needs `overwrite` (checked on entry, and again on exit in case another writer finished first)."""

    def __init__(self, out: str, overwrite: bool = False):
        self.out = os.path.abspath(out)
        self.overwrite = overwrite
        self.tmp = f"{self.out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def check(self) -> None:
        if os.path.exists(self.out) and not self.overwrite:
            raise FileExistsError(f"output {self.out} already exists (pass --overwrite to replace it)")

    def __enter__(self) -> str:
        self.check()
        os.makedirs(self.tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        old = None
        if os.path.exists(self.out):
            if not self.overwrite:  # someone else finished first
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise FileExistsError(f"output {self.out} appeared while writing (another writer?)")
            old = f"{self.out}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return False
