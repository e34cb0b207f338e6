"""RDMA devices and network namespaces, over the kernel's RDMA netlink (NETLINK_RDMA,
the `nldev` client that iproute2's `rdma` tool speaks).

In the RDMA subsystem's *shared* mode (the kernel's default) every RDMA device is visible
from every network namespace, and a container reaches its VF's RDMA device through the
device nodes the claim already gives it. In *exclusive* mode (`rdma system set netns
exclusive`) an RDMA device belongs to one network namespace: a pod that gets the netdev
must get its RDMA device too, or RoCE/verbs do not see it. Moving it is one
RDMA_NLDEV_CMD_SET with the device's index and a namespace file descriptor, sent from the
namespace the device is in. When that namespace is destroyed the kernel hands the device
back to the initial namespace by itself.

pyroute2 has no RDMA netlink, so the few messages needed are packed here. Numbers from
the kernel's include/uapi/rdma/rdma_netlink.h and include/uapi/linux/netlink.h.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

NETLINK_RDMA = 20
RDMA_NL_NLDEV = 5
CMD_GET, CMD_SET, CMD_SYS_GET = 1, 2, 6
ATTR_DEV_INDEX, ATTR_DEV_NAME, ATTR_NET_NS_FD, ATTR_SYS_NETNS_MODE = 1, 2, 68, 66

NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
SHARED, EXCLUSIVE = "shared", "exclusive"


class RdmaError(Exception):
    """An RDMA netlink request the kernel refused; the message names the device."""


def message_type(command: int) -> int:
    """RDMA_NL_GET_TYPE(RDMA_NL_NLDEV, command)."""
    return (RDMA_NL_NLDEV << 10) + command


def _attribute(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def encode(command: int, seq: int, flags: int, attributes: list[tuple[int, bytes]] = ()) -> bytes:
    body = b"".join(_attribute(kind, payload) for kind, payload in attributes)
    return _HEADER.pack(_HEADER.size + len(body), message_type(command), NLM_F_REQUEST | flags, seq, 0) + body


def u32(value: int) -> bytes:
    return struct.pack("=I", value)


@dataclass(frozen=True)
class Message:
    kind: int
    flags: int
    seq: int
    attributes: dict[int, bytes]
    error: int | None = None  # NLMSG_ERROR: 0 is an ack, negative an errno


def decode(data: bytes) -> Iterator[Message]:
    """The netlink messages of one datagram."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, flags, seq, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise RdmaError(f"malformed RDMA netlink message ({length} bytes at {offset})")
        body = data[offset + _HEADER.size:offset + length]
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", body)
            yield Message(kind, flags, seq, {}, code)
        else:
            yield Message(kind, flags, seq, _attributes(body))
        offset += (length + 3) & ~3


def _attributes(body: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    offset = 0
    while offset + 4 <= len(body):
        length, kind = struct.unpack_from("=HH", body, offset)
        if length < 4:
            break
        out[kind & 0x3FFF] = body[offset + 4:offset + length]  # without NESTED / BYTEORDER bits
        offset += (length + 3) & ~3
    return out


class RdmaNetlink:
    """One NETLINK_RDMA socket (in the namespace it was made in). `open` is replaceable
    for tests: a kernel without RDMA support has no such socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._seq = 0

    @classmethod
    def open(cls) -> "RdmaNetlink":
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_RDMA)
        except OSError as err:
            raise RdmaError(f"no RDMA netlink in this kernel: {err.strerror}") from None
        sock.bind((0, 0))
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RdmaNetlink":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _request(self, command: int, flags: int, attributes: list[tuple[int, bytes]] = ()) -> list[Message]:
        self._seq += 1
        seq = self._seq
        self.sock.send(encode(command, seq, flags | NLM_F_ACK, list(attributes)))
        replies: list[Message] = []
        while True:
            for message in decode(self.sock.recv(65536)):
                if message.seq != seq:
                    continue
                if message.error is not None:
                    if message.error < 0:
                        raise RdmaError(os.strerror(-message.error))
                    return replies  # the ack
                if message.kind == NLMSG_DONE:
                    return replies
                replies.append(message)

    def netns_mode(self) -> str:
        (reply,) = self._request(CMD_SYS_GET, 0) or (None,)
        if reply is None or ATTR_SYS_NETNS_MODE not in reply.attributes:
            return SHARED  # kernels before the netns modes (5.2) have only the shared one
        return SHARED if reply.attributes[ATTR_SYS_NETNS_MODE][:1] == b"\x01" else EXCLUSIVE

    def devices(self) -> dict[str, int]:
        """name -> index of the RDMA devices this namespace sees."""
        out = {}
        for reply in self._request(CMD_GET, NLM_F_DUMP):
            name = reply.attributes.get(ATTR_DEV_NAME, b"").split(b"\0", 1)[0].decode()
            index = reply.attributes.get(ATTR_DEV_INDEX)
            if name and index is not None:
                out[name] = struct.unpack("=I", index[:4])[0]
        return out

    def move(self, device: str, netns_fd: int) -> None:
        index = self.devices().get(device)
        if index is None:
            raise RdmaError(f"RDMA device {device} is not in this network namespace")
        try:
            self._request(CMD_SET, 0, [(ATTR_DEV_INDEX, u32(index)), (ATTR_NET_NS_FD, u32(netns_fd))])
        except RdmaError as err:
            raise RdmaError(f"moving RDMA device {device}: {err}") from None


# How the mover reaches RDMA netlink in a namespace (None: ours); tests give a fake.
Opener = Callable[[str | None], RdmaNetlink]
