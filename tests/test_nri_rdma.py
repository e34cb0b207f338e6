"""driver/nri/rdma.py and the RDMA half of a NIC move (exclusive netns mode).

This machine's kernel, like most CI kernels, has no RDMA subsystem (no NETLINK_RDMA, no
rdma_rxe to make a soft RoCE device), so the kernel side is a fake: the messages are
checked byte for byte against the layout of the kernel's uapi headers (rdma_netlink.h,
netlink.h), and the fake kernel answers as nldev.c does. The netdev half of each move is
real (real netdevs in real namespaces, as in test_nri_netdev.py)."""

from __future__ import annotations

import dataclasses
import os
import struct

import pytest

from driver.nri import rdma
from driver.nri.netdev import NetdevError, NetdevMover, record_name
from tests.test_nri_netdev import _REASON, host, link, placement, pods  # noqa: F401 - fixtures


def nlmsg(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def nla(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def test_a_move_request_is_the_kernels_layout():
    # RDMA_NL_GET_TYPE(RDMA_NL_NLDEV=5, RDMA_NLDEV_CMD_SET=2) = 5 << 10 | 2; attributes
    # RDMA_NLDEV_ATTR_DEV_INDEX (1) and RDMA_NLDEV_NET_NS_FD (68), both u32
    got = rdma.encode(rdma.CMD_SET, 7, rdma.NLM_F_ACK, [(1, rdma.u32(3)), (68, rdma.u32(9))])
    assert got == (struct.pack("=IHHII", 32, 5122, 0x1 | 0x4, 7, 0)
                   + struct.pack("=HHI", 8, 1, 3) + struct.pack("=HHI", 8, 68, 9))
    # a string attribute is padded to 4 bytes
    assert rdma._attribute(2, b"mlx5_0\0") == struct.pack("=HH", 11, 2) + b"mlx5_0\0" + b"\0"


class FakeKernel:
    """The nldev side of one NETLINK_RDMA socket: SYS_GET, GET (dump), SET (move)."""

    def __init__(self, mode: int = 0, devices: dict[str, int] | None = None, refuse: int = 0) -> None:
        self.mode = mode  # RDMA_NLDEV_SYS_ATTR_NETNS_MODE: 1 shared, 0 exclusive
        self.devices = dict(devices or {})
        self.refuse = refuse  # an errno for SET
        self.replies: list[bytes] = []
        self.moves: list[tuple[int, int]] = []

    def send(self, data: bytes) -> None:
        (request,) = list(rdma.decode(data))
        command = request.kind & 0x3FF
        assert request.kind >> 10 == rdma.RDMA_NL_NLDEV and request.flags & rdma.NLM_F_REQUEST
        ack = nlmsg(2, 0, request.seq, struct.pack("=i", 0) + data[:16])
        if command == rdma.CMD_SYS_GET:
            self.replies.append(nlmsg(request.kind, 0, request.seq, nla(66, bytes([self.mode]))) + ack)
        elif command == rdma.CMD_GET:
            assert request.flags & rdma.NLM_F_DUMP == rdma.NLM_F_DUMP
            for name, index in self.devices.items():
                self.replies.append(nlmsg(request.kind, 2, request.seq,
                                          nla(1, struct.pack("=I", index)) + nla(2, name.encode() + b"\0")))
            self.replies.append(nlmsg(3, 2, request.seq, struct.pack("=i", 0)))
        elif command == rdma.CMD_SET:
            index = struct.unpack("=I", request.attributes[1])[0]
            fd = struct.unpack("=I", request.attributes[68])[0]
            if self.refuse:
                self.replies.append(nlmsg(2, 0, request.seq, struct.pack("=i", -self.refuse) + data[:16]))
                return
            self.moves.append((index, fd))
            self.replies.append(ack)

    def recv(self, size: int) -> bytes:
        return self.replies.pop(0)

    def close(self) -> None:
        pass


def test_mode_devices_and_a_move_through_the_fake_kernel():
    kernel = FakeKernel(mode=0, devices={"mlx5_0": 0, "mlx5_3": 3})
    nl = rdma.RdmaNetlink(kernel)
    assert nl.netns_mode() == rdma.EXCLUSIVE
    assert nl.devices() == {"mlx5_0": 0, "mlx5_3": 3}
    nl.move("mlx5_3", 11)
    assert kernel.moves == [(3, 11)]
    assert rdma.RdmaNetlink(FakeKernel(mode=1)).netns_mode() == rdma.SHARED
    with pytest.raises(rdma.RdmaError, match="RDMA device mlx5_9 is not in this network namespace"):
        nl.move("mlx5_9", 11)
    refused = rdma.RdmaNetlink(FakeKernel(devices={"mlx5_3": 3}, refuse=17))
    with pytest.raises(rdma.RdmaError, match="moving RDMA device mlx5_3: File exists"):
        refused.move("mlx5_3", 11)


def test_a_kernel_without_rdma_netlink_is_one_clear_error():
    try:
        rdma.RdmaNetlink.open().close()
    except rdma.RdmaError as err:
        assert str(err).startswith("no RDMA netlink in this kernel")
    else:
        pytest.skip("this kernel has RDMA netlink")


class RdmaWorld:
    """RDMA devices and the namespace (inode) each is in, with one fake kernel socket per
    namespace that sees only its devices, as in exclusive mode."""

    def __init__(self, mode: int, devices: dict[str, str], refuse: int = 0) -> None:
        self.mode, self.refuse = mode, refuse
        self.where = {name: os.stat(netns).st_ino for name, netns in devices.items()}
        self.index = {name: i for i, name in enumerate(sorted(devices))}

    def open(self, netns: str | None) -> rdma.RdmaNetlink:
        here = os.stat(netns or "/proc/self/ns/net").st_ino
        world = self

        class Socket(FakeKernel):
            def send(self, data: bytes) -> None:
                self.devices = {n: world.index[n] for n, ino in world.where.items() if ino == here}
                super().send(data)
                for index, fd in self.moves:
                    name = next(n for n, i in world.index.items() if i == index)
                    world.where[name] = os.fstat(fd).st_ino
                self.moves.clear()

        return rdma.RdmaNetlink(Socket(mode=self.mode, refuse=self.refuse))

    def inside(self, name: str, netns: str) -> bool:
        return self.where[name] == os.stat(netns).st_ino


pytestmark_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def rdma_mover(host, tmp_path, world: RdmaWorld) -> NetdevMover:
    return NetdevMover(tmp_path / "records", host_netns=host.path, recreate=host.recreate, rdma_open=world.open)


def with_rdma(pod_ns: str):
    """The test placement (VF enp65s0f0v0 as net1) with its RDMA device mlx5_3."""
    return dataclasses.replace(placement(pod_ns, name="net1"), rdma_device="mlx5_3")


@pytestmark_netns
def test_exclusive_mode_moves_the_rdma_device_with_the_netdev_and_back(host, pods, tmp_path):
    host.add_nic("enp65s0f0v0")
    pod_ns = pods()
    world = RdmaWorld(mode=0, devices={"mlx5_3": host.path, "mlx5_4": host.path})
    mover = rdma_mover(host, tmp_path, world)
    mover.attach(with_rdma(pod_ns))
    assert world.inside("mlx5_3", pod_ns) and world.inside("mlx5_4", host.path)
    assert link(pod_ns, "net1") is not None
    record = (tmp_path / "records" / record_name("pod-1", "nic-0000-41-00-2")).read_text()
    assert '"rdma_device": "mlx5_3"' in record  # written before anything moved
    assert mover.detach("pod-1", "nic-0000-41-00-2")
    assert world.inside("mlx5_3", host.path) and link(host.path, "enp65s0f0v0") is not None


@pytestmark_netns
def test_shared_mode_leaves_the_rdma_device_where_it_is(host, pods, tmp_path):
    host.add_nic("enp65s0f0v0")
    pod_ns = pods()
    world = RdmaWorld(mode=1, devices={"mlx5_3": host.path})
    mover = rdma_mover(host, tmp_path, world)
    mover.attach(with_rdma(pod_ns))
    assert world.inside("mlx5_3", host.path) and link(pod_ns, "net1") is not None
    assert '"rdma_device": null' in (tmp_path / "records" / record_name("pod-1", "nic-0000-41-00-2")).read_text()


@pytestmark_netns
def test_a_refused_rdma_move_puts_the_netdev_back_and_names_the_rdma_device(host, pods, tmp_path):
    host.add_nic("enp65s0f0v0", addresses=("192.168.50.2/24",))
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    world = RdmaWorld(mode=0, devices={"mlx5_3": host.path}, refuse=17)
    mover = rdma_mover(host, tmp_path, world)
    with pytest.raises(NetdevError, match="moving RDMA device mlx5_3 into pod ml/trainer: moving RDMA device "
                                          "mlx5_3: File exists"):
        mover.attach(with_rdma(pod_ns))
    assert link(host.path, "enp65s0f0v0") == before and link(pod_ns, "net1") is None
    assert not list((tmp_path / "records").iterdir())


@pytestmark_netns
def test_reconcile_returns_the_rdma_device_of_a_pod_the_runtime_no_longer_has(host, pods, tmp_path):
    host.add_nic("enp65s0f0v0")
    pod_ns = pods()
    world = RdmaWorld(mode=0, devices={"mlx5_3": host.path})
    mover = rdma_mover(host, tmp_path, world)
    mover.attach(with_rdma(pod_ns))
    # a new driver process (the mode is read again), and the pod is not among the live ones
    again = rdma_mover(host, tmp_path, world)
    assert [r.rdma_device for r in again.reconcile(live_pods=set())] == ["mlx5_3"]
    assert world.inside("mlx5_3", host.path)


def test_without_rdma_netlink_the_mode_is_shared_and_nothing_moves(tmp_path):
    def none(netns):
        raise rdma.RdmaError("no RDMA netlink in this kernel: Protocol not supported")

    assert NetdevMover(tmp_path, rdma_open=none).rdma_mode() == rdma.SHARED


def test_a_pods_nic_carries_its_rdma_device_from_the_inventory(tmp_path):
    from driver.nri.pods import NicPods
    from tests.nri_runtime import pod
    from tests.test_nri_pods import MOVED, NIC, record

    nics = NicPods(NetdevMover(tmp_path), lambda: [record(MOVED)], {NIC: "enp65s0f0v0"}.get,
                   rdma_of={NIC: "mlx5_3"}.get)
    (want,) = nics.wanted(pod("u-1", "/var/run/netns/x", namespace="ml", name="trainer"))
    assert (want.host_ifname, want.rdma_device) == ("enp65s0f0v0", "mlx5_3")
