"""driver/devices/sysread.py: attribute files kept open and read again with pread."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from driver.devices import sysread
from driver.devices.sysread import HeldDirs, HeldFiles

LOOPBACK_RX = Path("/sys/class/net/lo/statistics/rx_bytes")


def open_descriptors(root: Path) -> int:
    """How many descriptors this process has open on files and directories under `root`.
    Only those: a thread an earlier test left behind may open or close others meanwhile
    (a count of all of them once failed a CI run by one)."""
    prefix = str(root.resolve()) + "/"
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        count += target.startswith(prefix)
    return count


@pytest.mark.skipif(not LOOPBACK_RX.exists(), reason="no /sys/class/net/lo on this machine")
def test_a_held_sysfs_attribute_reads_the_current_value():
    """The kernel's side, on the real sysfs: a pread at offset 0 of an attribute kept open
    produces the value afresh (the counters the sampler reads every 10 s)."""
    files = HeldFiles()
    first = int(files.read(str(LOOPBACK_RX)))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind(("127.0.0.1", 0))
        for _ in range(10):
            tx.sendto(b"x" * 1000, rx.getsockname())
            rx.recv(2000)
    second = int(files.read(str(LOOPBACK_RX)))
    assert second >= first + 10_000
    assert len(files) == 1
    files.close()


def test_a_held_file_is_opened_once_and_follows_writes_in_place(tmp_path):
    attribute = tmp_path / "operstate"
    attribute.write_text("up\n")
    files = HeldFiles()
    before = open_descriptors(tmp_path)
    assert files.read(str(attribute)) == b"up\n"
    attribute.write_text("down\n")  # in place, as the kernel changes an attribute
    assert files.read(str(attribute)) == b"down\n"
    assert files.read(str(attribute), limit=2) == b"do"
    assert len(files) == 1 and open_descriptors(tmp_path) == before + 1
    assert files.read(str(tmp_path / "missing")) is None
    assert len(files) == 1
    files.close()
    assert open_descriptors(tmp_path) == before
    # Closed, it still reads, holding nothing.
    assert files.read(str(attribute)) == b"down\n"
    assert len(files) == 0 and open_descriptors(tmp_path) == before


def test_read_many_answers_each_path_in_order_as_read_would(tmp_path):
    paths = []
    for i in range(3):
        (tmp_path / f"a{i}").write_text(f"{i}\n")
        paths.append(str(tmp_path / f"a{i}"))
    paths.insert(1, str(tmp_path / "missing"))
    files = HeldFiles()
    before = open_descriptors(tmp_path)
    assert files.read_many(paths) == [b"0\n", None, b"1\n", b"2\n"]
    (tmp_path / "a2").write_text("20\n")
    assert files.read_many(paths, limit=1) == [b"0", None, b"1", b"2"]
    assert files.read_many(paths) == [files.read(p) for p in paths]
    assert len(files) == 3 and open_descriptors(tmp_path) == before + 3
    files.close()
    assert files.read_many(paths) == [b"0\n", None, b"1\n", b"20\n"]
    assert open_descriptors(tmp_path) == before


def test_a_gone_device_is_read_again_by_path(tmp_path, monkeypatch):
    """sysfs answers a read of a removed device's open attribute with ENODEV; a device that
    came back under the same name is then read at its path. (A regular file cannot give
    ENODEV, so that answer is made here.)"""
    attribute = tmp_path / "operstate"
    attribute.write_text("up\n")
    files = HeldFiles()
    assert files.read(str(attribute)) == b"up\n"
    real_pread = os.pread
    gone: set[int] = set()  # descriptors whose device was removed (numbers are reused)

    def pread(fd, n, offset):
        if fd in gone:
            gone.discard(fd)
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    before = open_descriptors(tmp_path)
    gone.update(files._fds.values())
    attribute.unlink()
    attribute.write_text("lowerlayerdown\n")  # the device back, a new file
    assert files.read(str(attribute)) == b"lowerlayerdown\n"
    (held,) = files._fds.values()
    assert os.fstat(held).st_ino == attribute.stat().st_ino  # the new one is held...
    assert open_descriptors(tmp_path) == before  # ...and the old one closed
    gone.update(files._fds.values())
    attribute.unlink()
    assert files.read(str(attribute)) is None  # gone for good
    assert len(files) == 0
    files.close()


def test_past_its_limit_it_reads_without_holding(tmp_path):
    paths = []
    for index in range(3):
        paths.append(tmp_path / f"a{index}")
        paths[-1].write_text(f"{index}\n")
    files = HeldFiles(limit=2)
    before = open_descriptors(tmp_path)
    for _ in range(2):
        assert [files.read(str(p)) for p in paths] == [b"0\n", b"1\n", b"2\n"]
    assert len(files) == 2 and open_descriptors(tmp_path) == before + 2
    files.close()


def test_the_descriptors_are_closed_with_the_object(tmp_path):
    attribute = tmp_path / "rx_bytes"
    attribute.write_text("1\n")
    gc.collect()  # what earlier tests left for the collector
    before = open_descriptors(tmp_path)
    files = HeldFiles()
    files.read(str(attribute))
    assert open_descriptors(tmp_path) == before + 1
    del files
    gc.collect()
    assert open_descriptors(tmp_path) == before


def test_closing_while_another_thread_reads_never_breaks_a_read(tmp_path):
    """The plugin closes the prober's files from the event loop while a probe thread may
    still be reading: every read returns the value, and nothing stays open."""
    paths = []
    for index in range(50):
        paths.append(str(tmp_path / f"a{index}"))
        Path(paths[-1]).write_text("up\n")
    before = open_descriptors(tmp_path)
    for _ in range(20):
        files = HeldFiles()
        results, done = [], threading.Event()

        def reader():
            while not done.is_set():
                results.extend(files.read(p) for p in paths)

        thread = threading.Thread(target=reader)
        thread.start()
        while not results and thread.is_alive():  # a reader that died must not hang us
            time.sleep(0.001)
        files.close()
        done.set()
        thread.join()
        assert set(results) == {b"up\n"}
    assert open_descriptors(tmp_path) == before


def test_the_descriptor_limit_is_raised_to_the_hard_one():
    script = (
        "import resource\n"
        "from driver.devices import sysread\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "print(sysread.raise_descriptor_limit() == (min(256, hard), hard if hard != resource.RLIM_INFINITY else 1 << 20),"
        " resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr



# -- HeldDirs: attributes opened relative to a directory kept open ------------------------------
def device_dir(root: Path, name: str, mtu: str) -> Path:
    directory = root / "devices" / name
    directory.mkdir(parents=True)
    (directory / "mtu").write_text(mtu)
    return directory


def test_a_held_directory_follows_its_key_and_its_replacement(tmp_path):
    """What the path leads to decides what is read: a link that now leads elsewhere (the
    key changed: an interface name taken by another device) and a directory removed and
    made again under the same name (ENOENT through the old descriptor) are opened again."""
    first = device_dir(tmp_path, "a", "1500\n")
    second = device_dir(tmp_path, "b", "9000\n")
    link = tmp_path / "eth0"
    link.symlink_to(first)
    dirs = HeldDirs()
    before = open_descriptors(tmp_path)
    assert dirs.read(str(link), os.readlink(link), ("mtu", "absent")) == (b"1500\n", None)
    assert len(dirs) == 1 and open_descriptors(tmp_path) == before + 1
    (first / "mtu").write_text("1400\n")  # in place: the held directory reads it
    assert dirs.read(str(link), os.readlink(link), ("mtu",)) == (b"1400\n",)

    link.unlink()
    link.symlink_to(second)
    # The same key would read the old device: the caller's key is what keeps it right.
    assert dirs.read(str(link), str(first), ("mtu",)) == (b"1400\n",)
    assert dirs.read(str(link), os.readlink(link), ("mtu",)) == (b"9000\n",)
    assert len(dirs) == 1 and open_descriptors(tmp_path) == before + 1

    # Removed and made again under the same name and key.
    (second / "mtu").unlink()
    second.rmdir()
    device_dir(tmp_path, "b", "4000\n")
    assert dirs.read(str(link), os.readlink(link), ("mtu",)) == (b"4000\n",)
    assert len(dirs) == 1 and open_descriptors(tmp_path) == before + 1

    # Gone for good: nothing to read, nothing held after a sweep.
    shutil.rmtree(tmp_path / "devices" / "b")
    assert dirs.read(str(link), os.readlink(link), ("mtu",)) == (None,)
    dirs.sweep()
    dirs.sweep()
    assert len(dirs) == 0 and open_descriptors(tmp_path) == before


def test_held_directories_not_read_between_sweeps_are_closed(tmp_path):
    paths = [device_dir(tmp_path, f"d{i}", f"{i}\n") for i in range(3)]
    dirs = HeldDirs()
    before = open_descriptors(tmp_path)
    for path in paths:
        dirs.read(str(path), "k", ("mtu",))
    dirs.sweep()
    assert len(dirs) == 3 and open_descriptors(tmp_path) == before + 3
    dirs.read(str(paths[0]), "k", ("mtu",))
    dirs.sweep()
    assert len(dirs) == 1 and open_descriptors(tmp_path) == before + 1
    dirs.close()
    assert open_descriptors(tmp_path) == before
    # Closed, or with no key, it reads by path, holding nothing.
    assert dirs.read(str(paths[2]), "k", ("mtu",)) == (b"2\n",)
    assert HeldDirs().read(str(paths[1]), None, ("mtu",)) == (b"1\n",)
    assert open_descriptors(tmp_path) == before


def test_past_its_limit_a_directory_is_read_by_path(tmp_path):
    paths = [device_dir(tmp_path, f"d{i}", f"{i}\n") for i in range(3)]
    dirs = HeldDirs(limit=2)
    assert [dirs.read(str(p), "k", ("mtu",)) for p in paths] == [(b"0\n",), (b"1\n",), (b"2\n",)]
    assert len(dirs) == 2
    dirs.close()


# The kernel's side of HeldDirs, on a sysfs of a network namespace of our own: interfaces
# renamed, replaced under the same name, removed and added again. Every fingerprint taken
# through held directories must read what a fingerprint by path reads.
KERNEL_CHECK = r"""
import subprocess, sys
from pathlib import Path
from driver.devices import fingerprint
from driver.devices.sysread import HeldDirs

root = Path(sys.argv[1])
try:
    mounted = subprocess.run(["mount", "-t", "sysfs", "sysfs", str(root)], capture_output=True)
except FileNotFoundError:
    print("no `mount` command"); sys.exit(77)
if mounted.returncode:
    print(f"cannot mount a sysfs: {mounted.stderr.decode().strip()}"); sys.exit(77)

def ip(*args):
    try:
        done = subprocess.run(["ip", "link", *args], capture_output=True, text=True)
    except FileNotFoundError:
        print("no `ip` command (iproute2)"); sys.exit(77)
    if done.returncode:
        print(f"ip link {' '.join(args)}: {done.stderr.strip()}"); sys.exit(77)

ip("add", "dratest0", "type", "ifb")
dirs = HeldDirs()

def check(step, mtus):
    held, by_path = fingerprint.fingerprint(root, dirs), fingerprint.fingerprint(root)
    assert held == by_path, (step, held[1], by_path[1])
    for name, mtu in mtus.items():
        assert held[1][name][2] == mtu, (step, name, held[1][name])

ip("set", "dratest0", "mtu", "1400")
check("first", {"dratest0": b"1400\n"})
ip("set", "dratest0", "name", "dratest1")  # its entry keeps its inode; its link changes
ip("add", "dratest0", "type", "ifb")       # the name, taken by another device: same link
ip("set", "dratest0", "mtu", "1280")
check("renamed, name taken", {"dratest0": b"1280\n", "dratest1": b"1400\n"})
ip("del", "dratest0")
ip("add", "dratest0", "type", "ifb")
ip("set", "dratest0", "mtu", "1300")
check("removed, added again", {"dratest0": b"1300\n"})
ip("set", "dratest1", "name", "dratest2")
ip("set", "dratest2", "name", "dratest1")
ip("set", "dratest1", "mtu", "1500")
check("renamed away and back", {"dratest1": b"1500\n"})
functions, interfaces, _ = fingerprint.fingerprint(root, dirs)
assert len(dirs) == len(functions) + len(interfaces)  # lo, dratest0, dratest1: nothing stale
print("ok")
"""


def test_held_directories_follow_the_kernels_renames_and_new_devices(tmp_path):
    mountpoint = tmp_path / "sys"
    mountpoint.mkdir()
    try:
        done = subprocess.run(["unshare", "--net", "--mount", sys.executable, "-c", KERNEL_CHECK,
                               str(mountpoint)], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parent.parent)
    except OSError as err:
        pytest.skip(f"unshare cannot run: {err}")
    if done.returncode == 77:
        pytest.skip(f"no network namespace with ifb interfaces here: {done.stdout.strip()}")
    if done.returncode and "unshare" in done.stderr and "Traceback" not in done.stderr:
        pytest.skip(f"unshare --net --mount fails here: {done.stderr.strip()}")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
