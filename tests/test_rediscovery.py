"""Rediscovery in proportion to change (driver/devices/discovery.py with `Changes`,
driver/devices/fingerprint.py, driver/publish/hotplug.py): after random hotplug sequences the
incremental result equals a full discovery, both when uevents name what changed and
when only the periodic fingerprint can tell."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from pathlib import Path

import pytest

from driver.devices import fingerprint, mock
from driver.devices.sysread import HeldDirs
from driver.devices.discovery import Changes, discover
from driver.publish.hotplug import Rediscovery

PROFILE = """
nvidia: {driverVersion: "550.54.15", cudaDriverVersion: 12040}
managementNic: {model: i350, ifName: eno1}
roots:
  - numa: 0
    devices:
      - {type: nic, model: connectx-6dx, vfs: %d, rdma: true}
      - {type: nic, model: connectx-6dx, vfs: %d}
  - numa: 1
    devices:
      - {type: nic, model: e810, vfs: %d}
      - {type: gpu, model: h100-sxm5-80gb}
"""


def build(root: Path, vfs: tuple[int, int, int]):
    return mock.build(mock.parse(PROFILE % vfs, "hotplug.yaml"), root)


def listing(sysfs: Path) -> tuple[set[str], set[str]]:
    return (set(os.listdir(sysfs / "bus" / "pci" / "devices")), set(os.listdir(sysfs / "class" / "net")))


def uevents(before, after) -> Changes:
    """What the kernel announces: an add or remove for every function and interface."""
    return Changes(frozenset(before[0] ^ after[0]), frozenset(before[1] ^ after[1]))


def silent_edits(rng: random.Random, sysfs: Path) -> int:
    """Changes no uevent announces: a link going down, an MTU, a MAC set from the PF."""
    net = sysfs / "class" / "net"
    physical = [i for i in sorted(os.listdir(net)) if (net / i / "device").exists()]
    edits = 0
    for ifname in rng.sample(physical, k=min(len(physical), rng.randint(0, 3))):
        attribute, value = rng.choice([("operstate", "down"), ("mtu", "9000"),
                                       ("address", f"02:00:00:00:{rng.randint(0, 255):02x}:01")])
        (net / ifname / attribute).write_text(value + "\n")
        edits += 1
    return edits


def test_random_hotplug_incremental_equals_full(tmp_path):
    rng = random.Random(20261203)
    root = tmp_path / "node"
    vfs = (4, 0, 2)
    node = build(root, vfs)
    sources = node.sources()
    by_uevents = by_fingerprint = discover(sources)
    dirs = HeldDirs()  # as the driver takes it: directories kept open between passes
    baseline = fingerprint.fingerprint(sources.sysfs, dirs)
    before = listing(sources.sysfs)
    silent_before = False
    for step in range(30):
        vfs = tuple(rng.choice((0, 1, 3, 8)) if rng.random() < 0.5 else v for v in vfs)
        build(root, vfs)  # the tree is rewritten whole; what did not change reads the same
        silent = silent_edits(rng, sources.sysfs) > 0 if rng.random() < 0.4 else False
        after = listing(sources.sysfs)
        full = discover(sources)

        # Periodic only: the fingerprint finds what changed, uevents or not.
        now = fingerprint.fingerprint(sources.sysfs, dirs)
        assert now == fingerprint.fingerprint(sources.sysfs), f"step {step}: a held directory read stale"
        assert len(dirs) == len(now[0]) + len(now[1]), "what is gone is closed, what is new held"
        by_fingerprint = discover(sources, by_fingerprint, fingerprint.changes(baseline, now))
        assert by_fingerprint == full, f"step {step}: fingerprint-driven result differs"

        # Uevents: they name every function and interface added or removed; a change
        # without a uevent (this step's edits, or last step's undone by the rebuild) is
        # the periodic pass's to find.
        by_uevents = discover(sources, by_uevents, uevents(before, after))
        if not (silent or silent_before):
            assert by_uevents == full, f"step {step}: uevent-driven result differs (vfs {vfs})"
        else:
            by_uevents = discover(sources, by_uevents, fingerprint.changes(baseline, now))
            assert by_uevents == full, f"step {step}: uevents then the periodic pass differ"
        baseline, before, silent_before = now, after, silent


def test_one_vf_is_read_again_not_the_node(tmp_path):
    """One VF added: its function, its PF and its interface are read; nothing else."""
    root = tmp_path / "node"
    node = build(root, (4, 0, 0))
    sources = node.sources()
    first = discover(sources)
    before = listing(sources.sysfs)
    build(root, (5, 0, 0))
    changes = uevents(before, listing(sources.sysfs))
    assert len(changes.functions) == 1 and len(changes.interfaces) == 1
    reads: list[str] = []
    links: list[str] = []
    real_open, real_readlink = open, os.readlink

    def counting_open(path, *args, **kwargs):
        reads.append(str(path))
        return real_open(path, *args, **kwargs)

    def counting_readlink(path, *args, **kwargs):
        links.append(str(path))
        return real_readlink(path, *args, **kwargs)

    import builtins
    builtins.open, os.readlink = counting_open, counting_readlink
    try:
        second = discover(sources, first, changes)
    finally:
        builtins.open, os.readlink = real_open, real_readlink
    assert second == discover(sources)
    (vf,) = changes.functions
    pf = second.inventory.get("nic-" + vf.replace(":", "-").replace(".", "-")).attributes["pfPciBusID"]
    sysfs_reads = {r for r in reads if str(sources.sysfs) in r and "/class/infiniband_verbs/" not in r}
    touched = {r.split("/devices/")[-1].split("/")[-2] if "/devices/" in r else r for r in sysfs_reads}
    outside = [r for r in sysfs_reads if vf not in r and pf not in r and "/net/" not in r
               and not r.endswith(("/route", "/ipv6_route"))]
    assert not outside, f"read beyond the VF and its PF: {sorted(outside)[:5]}"
    assert len(sysfs_reads) < 60, (len(sysfs_reads), sorted(touched))
    # Where the other interfaces and uverbs entries lead is not asked again either: the
    # new VF's interface and entry, and the entries of the VF's PF (read again with it).
    (ifname,) = changes.interfaces
    class_links = {p.split("/class/", 1)[1] for p in links
                   if "/class/" in p and p.split("/class/", 1)[1].count("/") == 1}
    pf_entries = {e for e in os.listdir(sources.sysfs / "class" / "infiniband_verbs")
                  if os.path.realpath(sources.sysfs / "class" / "infiniband_verbs" / e).split("/")[-3] in (vf, pf)}
    assert class_links == {f"net/{ifname}"} | {f"infiniband_verbs/{e}" for e in pf_entries}


def test_a_uverbs_entry_that_moves_is_read_again(tmp_path):
    """The kernel numbers uverbs entries lowest free: two VFs' RDMA devices re-created in
    the other order swap numbers, with no interface changing. The fingerprint names both
    functions, and so do their uevents; either way discovery reads those entries again,
    and only those."""
    root = tmp_path / "node"
    node = build(root, (2, 0, 0))
    sources = node.sources()
    first = discover(sources)
    baseline = fingerprint.fingerprint(sources.sysfs)
    verbs = sources.sysfs / "class" / "infiniband_verbs"
    a, b = sorted(os.listdir(verbs))[1:3]  # uverbs0 is the PF's; these are its two VFs'
    dir_a, dir_b = (verbs / a).resolve(), (verbs / b).resolve()
    function_a, function_b = dir_a.parent.parent.name, dir_b.parent.parent.name
    ibdev_a, ibdev_b = (dir_a / "ibdev").read_text(), (dir_b / "ibdev").read_text()
    for gone in (dir_a, dir_b):
        (gone / "ibdev").unlink()
        gone.rmdir()
    # B's RDMA device now has entry `a`, A's has `b`; the RDMA devices keep their names.
    for entry, function_dir, ibdev in ((a, dir_b.parent, ibdev_b), (b, dir_a.parent, ibdev_a)):
        (function_dir / entry).mkdir()
        (function_dir / entry / "ibdev").write_text(ibdev)
        (verbs / entry).unlink()
        (verbs / entry).symlink_to(os.path.relpath(function_dir / entry, verbs))
    full = discover(sources)
    assert full != first, "the NICs' uverbs device nodes changed"

    now = fingerprint.fingerprint(sources.sysfs)
    by_fingerprint = fingerprint.changes(baseline, now)
    assert by_fingerprint == Changes(frozenset({function_a, function_b}), frozenset())
    assert discover(sources, first, by_fingerprint) == full
    by_uevents = Changes(functions=frozenset({function_a, function_b}))
    assert discover(sources, first, by_uevents) == full


def test_rediscovery_scopes_uevents_and_fingerprints_the_periodic_pass(tmp_path):
    root = tmp_path / "node"
    node = build(root, (2, 0, 0))
    sources = node.sources()
    dirs = HeldDirs()  # as the plugin wires it
    baseline = fingerprint.fingerprint(sources.sysfs, dirs)
    first = discover(sources)
    seen = []
    rediscovery = Rediscovery(lambda: discover(sources), seen.append, first, interval=3600, quiet=0.05,
                              incremental=lambda previous, what: discover(sources, previous, what),
                              scan=lambda: fingerprint.fingerprint(sources.sysfs, dirs),
                              diff=fingerprint.changes, baseline=baseline, release=dirs.close)

    async def scenario():
        task = asyncio.create_task(rediscovery.run())
        await asyncio.sleep(0.05)
        before = listing(sources.sysfs)
        build(root, (3, 0, 0))
        what = uevents(before, listing(sources.sysfs))
        for bdf in what.functions:
            rediscovery.notify("pci", "add", bdf)
        for ifname in what.interfaces:
            rediscovery.notify("net", "add", ifname)
        await wait_for(lambda: rediscovery.runs == 1)
        assert rediscovery.full_runs == 0 and rediscovery.last_changes == what
        # A change no uevent announced: the periodic pass finds that interface (and reads
        # the VF once more: its fingerprint is from before the uevents).
        vf = next(iter(what.interfaces))
        (sources.sysfs / "class" / "net" / vf / "operstate").write_text("down\n")
        await rediscovery.rediscover(periodic=True)
        assert rediscovery.full_runs == 0
        assert rediscovery.last_changes.interfaces == {vf}
        assert rediscovery.last_changes.functions <= what.functions
        # A notify without a name (a device lost, the MIG mode changed): a full discovery.
        rediscovery.notify()
        await wait_for(lambda: rediscovery.full_runs == 1)
        assert len(dirs) > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert len(dirs) == 0, "the fingerprint's directories are closed when rediscovery stops"

    asyncio.run(scenario())
    assert len(seen) == 2, "the VF, then its link going down"
    assert seen[-1] == discover(sources)


def test_a_failed_incremental_run_is_followed_by_a_full_discovery(tmp_path):
    """The changes a failed run took are not dropped: the next run, the periodic one with
    nothing new in its fingerprint included, reads the whole node again."""
    root = tmp_path / "node"
    node = build(root, (2, 0, 0))
    sources = node.sources()
    first = discover(sources)
    failures = [OSError("sysfs read failed")]

    def incremental(previous, what):
        if failures:
            raise failures.pop()
        return discover(sources, previous, what)

    seen = []
    rediscovery = Rediscovery(lambda: discover(sources), seen.append, first, interval=3600,
                              incremental=incremental,
                              scan=lambda: fingerprint.fingerprint(sources.sysfs),
                              diff=fingerprint.changes,
                              baseline=fingerprint.fingerprint(sources.sysfs))

    async def scenario():
        rediscovery._loop, rediscovery._poke = asyncio.get_running_loop(), asyncio.Event()
        before = listing(sources.sysfs)
        build(root, (3, 0, 0))
        for bdf in uevents(before, listing(sources.sysfs)).functions:
            rediscovery.notify("pci", "add", bdf)
        await asyncio.sleep(0)  # notify hands its change over through the loop
        try:
            await rediscovery.rediscover()
        except OSError:
            pass
        else:
            raise AssertionError("the incremental run was to fail")
        assert seen == [] and rediscovery.full_runs == 0
        # The periodic pass: its fingerprint already moved past the VF, so only a full
        # discovery can find it.
        assert await rediscovery.rediscover(periodic=True)
        assert rediscovery.full_runs == 1

    asyncio.run(scenario())
    assert seen == [discover(sources)]


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
