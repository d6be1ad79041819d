"""A checkpoint directory on a small filesystem for the `diskfull` fault: a tmpfs mounted over it (root only)
whose size limit the drill brings down to what it already holds, so that the job's next save finds no space,
and back up once the job is down."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SLACK = 64 << 10  # bytes left when full: orbax's small metadata writes fail as surely as its array files


class DiskError(RuntimeError):
    """The small filesystem cannot be set up or resized here; the message says why."""


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DiskError(f"mount {' '.join(args)} failed: {proc.stderr.strip() or proc.returncode}")


class SmallDisk:
    """A tmpfs mounted over `path` (created, empty), `size` bytes at most while not full."""

    def __init__(self, path: Path, size: int = 8 << 30):
        if os.geteuid() != 0:
            raise DiskError(f"mounting a tmpfs needs root (running as uid {os.geteuid()})")
        self.path, self.size = Path(path), size
        self.path.mkdir(parents=True, exist_ok=True)
        if any(self.path.iterdir()):
            raise DiskError(f"{self.path} is not empty")
        _mount("-t", "tmpfs", "-o", f"size={size}", "drill-diskfull", str(self.path))
        self.mounted = True

    def used(self) -> int:
        stat = os.statvfs(self.path)
        return (stat.f_blocks - stat.f_bfree) * stat.f_frsize

    def fill(self, attempts: int = 50) -> int:
        """Limit the filesystem to what it holds plus `SLACK`; returns the new limit in bytes."""
        while True:
            limit = self.used() + SLACK
            try:
                _mount("-o", f"remount,size={limit}", str(self.path))
                return limit
            except DiskError:
                # tmpfs refuses a size below what it holds: a save in flight wrote more than SLACK between the
                # measure and the remount. Measure again; a remount that fails on a still size is a real error.
                attempts -= 1
                if attempts == 0 or self.used() + SLACK <= limit:
                    raise

    def free(self) -> None:
        """Give the space back."""
        _mount("-o", f"remount,size={self.size}", str(self.path))

    def close(self) -> None:
        """Unmount, leaving a copy of what the filesystem held in its place."""
        if not self.mounted:
            return
        keep = self.path.with_name(self.path.name + ".drill-copy")
        shutil.copytree(self.path, keep, symlinks=True)
        proc = subprocess.run(["umount", str(self.path)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise DiskError(f"umount {self.path} failed: {proc.stderr.strip()}")
        self.mounted = False
        self.path.rmdir()
        keep.rename(self.path)


def mount_problem(scratch: Path) -> str | None:
    """Why a small filesystem cannot be mounted here (None: it can), tried on an empty directory `scratch`."""
    try:
        disk = SmallDisk(scratch, size=1 << 20)
    except DiskError as exc:
        return str(exc)
    disk.close()
    return None
