"""driver/nri/netdev.py with real netdevs in real network namespaces (tests run as root).

The mock's NICs live in a namespace of their own (driver/nri/mocknet.py) and each "pod"
is a namespace made here, so every move, rename, address and return is real netlink.
"""

from __future__ import annotations

import ipaddress
import json
import os
import statistics
import time
import uuid

import pytest
from pyroute2 import IPRoute, netns as pyroute2_netns

from driver.nri.mocknet import MockNetwork
from driver.nri.netdev import (InterfaceConfig, NetdevError, NetdevMover, Placement, Route,
                               netlink, record_name)
from tests import netns as netns_support


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "moving netdevs between network namespaces needs root"
    return netns_support.available()


_REASON = _unavailable()
if _REASON and os.environ.get("CI"):
    raise RuntimeError(f"CI must run the NIC move tests as root with netns: {_REASON}")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def host():
    network = MockNetwork(_name("dra-test-host"))
    network.create()
    yield network
    network.destroy()


@pytest.fixture
def pods():
    made: list[str] = []

    def make() -> str:
        name = _name("dra-test-pod")
        pyroute2_netns.create(name)
        made.append(name)
        return f"/var/run/netns/{name}"

    yield make
    for name in made:
        if os.path.exists(f"/var/run/netns/{name}"):
            pyroute2_netns.remove(name)


def link(netns: str, ifname: str) -> dict | None:
    with netlink(netns) as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            return None
        msg = ipr.get_links(found[0])[0]
        addresses = sorted(f"{a.get('address')}/{a['prefixlen']}"
                           for a in ipr.get_addr(index=found[0])
                           if not ipaddress.ip_address(a.get("address")).is_link_local)
        routes = sorted(f"{r.get('dst')}/{r['dst_len']} via {r.get('gateway')}"
                        for r in ipr.get_routes(oif=found[0]) if r.get("gateway"))
        return {"mtu": msg.get("mtu"), "mac": msg.get("address"),
                "up": bool(msg["flags"] & 1), "addresses": addresses, "routes": routes}


def placement(netns: str, **config) -> Placement:
    return Placement(claim_uid="claim-1", device="nic-0000-41-00-2", host_ifname="enp65s0f0v0",
                     pod_uid="pod-1", pod="ml/trainer", netns=netns,
                     config=InterfaceConfig(**config))


def test_move_into_pod_configure_and_return(host, pods, tmp_path) -> None:
    mac = host.add_nic("enp65s0f0v0", mtu=9000, addresses=("192.168.50.2/24",))
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path / "records", host_netns=host.path, recreate=host.recreate)

    data = mover.attach(placement(pod_ns, name="net1", addresses=("10.1.0.5/24", "fd00::5/64"),
                                  mtu=1400, routes=(Route("10.2.0.0/16", "10.1.0.1"),)))
    assert data.interface_name == "net1"
    assert data.hardware_address == mac
    assert set(data.ips) == {"10.1.0.5/24", "fd00::5/64"}
    assert link(host.path, "enp65s0f0v0") is None
    inside = link(pod_ns, "net1")
    assert inside == {"mtu": 1400, "mac": mac, "up": True,
                      "addresses": ["10.1.0.5/24", "fd00::5/64"],
                      "routes": ["10.2.0.0/16 via 10.1.0.1"]}
    record = json.loads((tmp_path / "records" / record_name("pod-1", "nic-0000-41-00-2"))
                        .read_text())
    assert record["state"] == "moved" and record["host"]["addresses"] == ["192.168.50.2/24"]

    # RunPodSandbox again (a retry, a restarted driver): nothing moves, same answer.
    assert mover.attach(placement(pod_ns, name="net1", addresses=("10.1.0.5/24",))) == data

    assert mover.detach("pod-1", "nic-0000-41-00-2")
    assert link(pod_ns, "net1") is None
    assert link(host.path, "enp65s0f0v0") == before
    assert not list((tmp_path / "records").iterdir())
    assert not mover.detach("pod-1", "nic-0000-41-00-2")


def test_keeps_the_host_name_when_the_config_names_none(host, pods, tmp_path) -> None:
    host.add_nic("enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path, host_netns=host.path)
    assert mover.attach(placement(pod_ns)).interface_name == "enp65s0f0v0"
    assert link(pod_ns, "enp65s0f0v0")["up"]
    mover.detach("pod-1", "nic-0000-41-00-2")
    assert link(host.path, "enp65s0f0v0") is not None


def test_a_name_taken_in_the_pod_fails_and_leaves_the_nic_on_the_host(host, pods,
                                                                      tmp_path) -> None:
    host.add_nic("enp65s0f0v0", mtu=9000)
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    with netlink(pod_ns) as ipr:
        ipr.link("add", ifname="eth0", kind="veth", peer={"ifname": "eth0p"})
    mover = NetdevMover(tmp_path, host_netns=host.path)
    with pytest.raises(NetdevError) as err:
        mover.attach(placement(pod_ns, name="eth0"))
    assert "claim claim-1: device nic-0000-41-00-2: moving enp65s0f0v0 into pod ml/trainer " \
           "as eth0" in str(err.value)
    assert link(host.path, "enp65s0f0v0") == before
    assert not list(tmp_path.glob("*.json"))


def test_a_config_the_kernel_refuses_is_rolled_back(host, pods, tmp_path) -> None:
    host.add_nic("enp65s0f0v0", addresses=("192.168.50.2/24",))
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate)
    # A gateway outside every subnet of the interface: ENETUNREACH from the kernel.
    with pytest.raises(NetdevError, match="configuring net1 in pod ml/trainer"):
        mover.attach(placement(pod_ns, name="net1", addresses=("10.1.0.5/24",),
                               routes=(Route("10.2.0.0/16", "172.31.0.1"),)))
    assert link(pod_ns, "net1") is None
    assert link(host.path, "enp65s0f0v0") == before
    assert not list(tmp_path.glob("*.json"))


def test_a_missing_interface_or_namespace_is_one_clear_error(host, pods, tmp_path) -> None:
    mover = NetdevMover(tmp_path, host_netns=host.path)
    with pytest.raises(NetdevError, match="device nic-0000-41-00-2: interface enp65s0f0v0 is "
                                          "not on the host"):
        mover.attach(placement(pods()))
    host.add_nic("enp65s0f0v0")
    with pytest.raises(NetdevError, match="network namespace /var/run/netns/nope: No such file or "
                                          r"directory \(.*chart value nri.netnsDirs\)"):
        mover.attach(placement("/var/run/netns/nope"))
    assert not os.path.exists("/var/run/netns/nope")  # looked up, never created
    assert link(host.path, "enp65s0f0v0") is not None
    assert not list(tmp_path.glob("*.json"))


def test_reconcile_brings_back_a_nic_from_a_dead_namespace(host, pods, tmp_path) -> None:
    """The driver was down while the pod went away: its namespace is gone, and with it
    (for a virtual mock NIC) the interface; the record brings it back as it was."""
    host.add_nic("enp65s0f0v0", mtu=9000, addresses=("192.168.50.2/24",))
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate)
    mover.attach(placement(pod_ns, name="net1", mtu=1400, addresses=("10.1.0.5/24",)))
    pyroute2_netns.remove(os.path.basename(pod_ns))

    restarted = NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate)
    undone = restarted.reconcile()
    assert [(r.pod_uid, r.device) for r in undone] == [("pod-1", "nic-0000-41-00-2")]
    assert link(host.path, "enp65s0f0v0") == before
    assert not list(tmp_path.glob("*.json"))


def test_reconcile_undoes_a_move_the_driver_died_in(host, pods, tmp_path) -> None:
    """Killed after the record and the move, before configuring: the record still says
    "moving", the NIC sits unconfigured in the pod under its new name."""
    host.add_nic("enp65s0f0v0", mtu=9000, addresses=("192.168.50.2/24",))
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate)
    mover.attach(placement(pod_ns, name="net1"))
    path = tmp_path / record_name("pod-1", "nic-0000-41-00-2")
    record = json.loads(path.read_text())
    record["state"], record["network"] = "moving", None
    path.write_text(json.dumps(record))

    assert [r.device for r in mover.reconcile()] == ["nic-0000-41-00-2"]
    assert link(pod_ns, "net1") is None
    assert link(host.path, "enp65s0f0v0") == before


def test_reconcile_returns_nics_of_pods_the_runtime_no_longer_has(host, pods,
                                                                  tmp_path) -> None:
    host.add_nic("enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path, host_netns=host.path)
    mover.attach(placement(pod_ns, name="net1"))
    assert mover.reconcile(live_pods={"pod-1"}) == []
    assert link(pod_ns, "net1") is not None
    assert [r.pod_uid for r in mover.reconcile(live_pods={"other"})] == ["pod-1"]
    assert link(host.path, "enp65s0f0v0") is not None


def test_move_latency(host, pods, tmp_path) -> None:
    """attach and detach each well inside NRI's 2 s request timeout."""
    host.add_nic("enp65s0f0v0")
    pod_ns = pods()
    mover = NetdevMover(tmp_path, host_netns=host.path)
    attach, detach = [], []
    for _ in range(30):
        started = time.monotonic()
        mover.attach(placement(pod_ns, name="net1", addresses=("10.1.0.5/24",), mtu=1400,
                               routes=(Route("10.2.0.0/16", "10.1.0.1"),)))
        attach.append(time.monotonic() - started)
        started = time.monotonic()
        mover.detach("pod-1", "nic-0000-41-00-2")
        detach.append(time.monotonic() - started)
    cuts = statistics.quantiles(attach, n=100)
    print(f"attach p50 {cuts[49] * 1000:.1f} ms p99 {cuts[98] * 1000:.1f} ms; detach p50 "
          f"{statistics.median(detach) * 1000:.1f} ms")
    assert max(attach) < 1.0 and max(detach) < 1.0


KILLED_MID_MOVE = r"""
import os, signal, sys
from pathlib import Path
from pyroute2 import IPRoute
import driver.nri.netdev as netdev

records, host_path, pod_ns, step = sys.argv[1:5]


class Dying:
    # pyroute2's socket, except that the process dies right after the kernel moved the
    # netdev (step=move) or set its MTU in the pod (step=configure): SIGKILL, no cleanup.
    def __init__(self):
        self.real = IPRoute()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def link(self, command, **kwargs):
        result = self.real.link(command, **kwargs)
        if (step == "move" and "net_ns_fd" in kwargs) or (step == "configure"
                                                           and kwargs.get("mtu") == 1400):
            os.kill(os.getpid(), signal.SIGKILL)
        return result


netdev.IPRoute = Dying
mover = netdev.NetdevMover(Path(records), host_netns=host_path)
mover.attach(netdev.Placement("claim-1", "nic-0000-41-00-2", "enp65s0f0v0", "pod-1",
                              "ml/trainer", pod_ns, netdev.InterfaceConfig(
                                  name="net1", mtu=1400, addresses=("10.1.0.5/24",))))
"""


@pytest.mark.parametrize("step", ["move", "configure"])
def test_a_driver_killed_in_the_middle_leaves_a_record_that_undoes_it(host, pods, tmp_path,
                                                                       step) -> None:
    """SIGKILL right after the kernel moved the netdev, or halfway through configuring
    it: the record was on disk before, and the next start brings the NIC back as it was."""
    import subprocess
    import sys

    host.add_nic("enp65s0f0v0", mtu=9000, addresses=("192.168.50.2/24",))
    before = link(host.path, "enp65s0f0v0")
    pod_ns = pods()
    done = subprocess.run([sys.executable, "-c", KILLED_MID_MOVE, str(tmp_path), host.path,
                           pod_ns, step], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == -9, done.stderr
    assert link(host.path, "enp65s0f0v0") is None  # it did leave
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["state"] == "moving" and record["host"]["mtu"] == 9000

    undone = NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate).reconcile()
    assert [r.device for r in undone] == ["nic-0000-41-00-2"]
    assert link(host.path, "enp65s0f0v0") == before
    assert link(pod_ns, "net1") is None and link(pod_ns, "enp65s0f0v0") is None


def test_the_mock_takes_a_dead_instances_leftover_mount_point_for_no_namespace():
    """A driver pod's bind mount of the mock's namespace lives in its container's mount
    namespace only; after the pod, the host folder keeps the empty file. The next instance
    must make a namespace there, not run netlink against the empty file."""
    network = MockNetwork(_name("dra-test-stale"))
    os.makedirs("/var/run/netns", exist_ok=True)
    open(network.path, "w").close()  # the mount point a dead container left
    try:
        network.create()
        mac = network.add_nic("dratst0")  # fails on the empty file: it is no namespace
        assert link(network.path, "dratst0")["mac"] == mac
        network.create()  # a live one is kept (the NIC stays)
        assert link(network.path, "dratst0") is not None
    finally:
        network.destroy()
        if os.path.lexists(network.path):
            os.unlink(network.path)


def test_a_mock_nic_left_in_a_pod_no_record_names_is_not_made_again(host, pods, caplog):
    """Seen on the 1.32 and 1.34 tiers: a failed case left a VF in a pod, the next driver
    start (with records that do not name it) made the NIC again and died of the kernel's
    "File exists" (the veth's other end is still in the mock's namespace)."""
    mac = host.add_nic("dratst1")
    pod_ns = pods()
    with netlink(host.path) as ipr, open(pod_ns) as target:
        ipr.link("set", index=ipr.link_lookup(ifname="dratst1")[0], net_ns_fd=target.fileno())
    assert link(host.path, "dratst1") is None and link(pod_ns, "dratst1")["mac"] == mac
    host.populate(set())  # no sysfs: nothing listed
    assert host.add_nic("dratst1") == mac  # was: NetlinkError (17, 'File exists')
    assert link(host.path, "dratst1") is None, "made twice: on the host and in the pod"
    assert link(pod_ns, "dratst1")["mac"] == mac


def test_a_mock_nic_the_kernel_refuses_is_one_line_at_start(host, capsys):
    host.add_nic_or_say("x" * 20)  # longer than IFNAMSIZ: the kernel refuses it
    out = capsys.readouterr()
    (line,) = [entry for entry in (out.out + out.err).splitlines() if "mock_nic_not_created" in entry]
    assert "x" * 20 in line and "Traceback" not in out.out + out.err
