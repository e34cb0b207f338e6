"""Unix sockets for the kubelet: replaced atomically at start, only our own removed at stop.

gRPC unlinks the path it bound when the server stops. During an upgrade without unique
socket names the new pod has by then replaced the old pod's socket file, and the old pod
would delete the new one's. So we bind a private dot-name (the kubelet ignores dot files),
rename it onto the public path (atomic: no moment without a socket, stale files from a
crash replaced), and at stop remove the public path only if it is still our inode.
"""

from __future__ import annotations

import itertools
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

_counter = itertools.count()


@dataclass
class OwnedSocket:
    path: Path
    inode: int | None = None
    _private: Path | None = field(default=None, repr=False)

    def address(self) -> str:
        """Where to bind: a private name beside the public path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = self.path.lstat().st_mode
            if not stat.S_ISSOCK(mode):
                raise FileExistsError(f"{self.path} exists and is not a socket; refusing to replace it")
        except FileNotFoundError:
            pass
        self._private = self.path.parent / f".b{os.getpid()}-{next(_counter)}"
        self._private.unlink(missing_ok=True)
        return f"unix://{self._private}"

    def publish(self) -> None:
        """After binding: move the socket onto its public name and remember it is ours."""
        assert self._private is not None, "address() first"
        os.replace(self._private, self.path)
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
