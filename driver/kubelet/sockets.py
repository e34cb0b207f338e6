"""Unix sockets for the kubelet: stale ones replaced at start, only our own removed at stop.

During an upgrade without unique socket names the new pod replaces the old pod's socket
file; the old pod must then not delete the new one's on its way out. We remember the inode
we bound and remove the path only if it is still ours.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass
class OwnedSocket:
    path: Path
    inode: int | None = None

    def prepare(self) -> str:
        """Make room for binding; returns the gRPC address."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return f"unix://{self.path}"
        if not stat.S_ISSOCK(mode):
            raise FileExistsError(f"{self.path} exists and is not a socket; refusing to replace it")
        self.path.unlink()  # a socket left by a crashed instance
        return f"unix://{self.path}"

    def claim(self) -> None:
        """Call after binding: remember which file is ours."""
        self.inode = self.path.stat().st_ino

    def remove(self) -> bool:
        if self.inode is None:
            return False
        try:
            if self.path.stat().st_ino != self.inode:
                return False  # replaced by another instance: leave it alone
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False
        finally:
            self.inode = None


def socket_path_ok(path: Path) -> bool:
    return len(os.fsencode(str(path))) <= 107
