"""The README's demo runs end to end (with a real container where podman can run)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from driver.demo.podman import busybox_rootfs as podman_rootfs
from driver.demo.podman import ready as podman_ready
from driver.devices import mock
from tests.conftest import REPO
from tests.test_examples import DYNAMIC_MIG, INTENT, NEEDS_NRI


def test_demo_runs():
    proc = subprocess.run([sys.executable, "-m", "driver", "demo"], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "talking v1.DRAPlugin" in out
    assert "published 11 devices in 3 ResourceSlices" in out
    # GPUs are published as consumable: a claim that asks for no capacity gets all of it.
    assert ("allocated: gpu -> gpu-0000-11-00-0 (share: no compute reserved, memory 79Gi), "
            "nic -> nic-0000-12-00-0") in out, "aligned on pci0000:10"
    assert "allocated: fpga -> fpga-0000-31-00-1" in out
    # Two claims packed onto the other GPU, each with its own limits.
    assert "allocated: gpu -> gpu-0000-21-00-0 (share: compute 30%, memory 20Gi)" in out
    assert "allocated: gpu -> gpu-0000-21-00-0 (share: compute 50%, memory 30Gi)" in out
    assert "unprepared 5 claims; CDI specs left: 0" in out
    for limit in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M"):
        assert limit in out
    if podman_ready() is None or os.environ.get("CI"):
        assert out.count("container saw:") == 5
        assert "DRA_NIC_0000_12_00_0_RDMA_DEVICE=mlx5_0" in out and "/dev/nvidia0" in out
        assert "NCCL_IB_HCA=auto" in out, "the claim's opaque config reached the container"
        assert out.count("MPS pipe directory: control") == 2, "both share containers see the daemon"


def _demo(*args: str, cdi_root=None) -> tuple[int, list[str], list[str]]:
    """The demo in this process (it still runs the driver as a real process)."""
    from driver import demo
    out, err = [], []
    profile = args[args.index("--profile") + 1] if "--profile" in args else "mixed"
    claim = Path(args[args.index("--claim") + 1]) if "--claim" in args else None
    mig_mode = args[args.index("--mig-mode") + 1] if "--mig-mode" in args else "static"
    code = demo.main(profile, out=out.append, err=err.append, claim_file=claim, cdi_root=cdi_root,
                     mig_mode=mig_mode)
    for line in err:  # a failed demo keeps its driver log for the user; a test does not
        if "driver log kept in " in line:
            shutil.rmtree(Path(line.split("driver log kept in ", 1)[1]).parent, ignore_errors=True)
    return code, out, err


def _driver_processes(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "driver" in cmdline and " run" in cmdline.replace("\0", " "):
                pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("profile", mock.builtin_profiles())
def test_the_demo_works_on_every_profile(profile, tmp_path):
    code, out, err = _demo("--profile", profile, cdi_root=tmp_path)
    assert code == 0, "\n".join(out + err)
    text = "\n".join(out)
    assert "CDI specs left: 0" in text and "prepared:" in text
    assert not list(tmp_path.glob("*.json"))


def _podman_or_skip() -> None:
    """Container tests: skipped where podman cannot run, except under CI, where they fail."""
    why = podman_ready()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the container tests, but podman cannot run: {why}")
        pytest.skip(f"podman cannot run here: {why}")


@pytest.mark.parametrize("name", sorted(INTENT))
def test_demo_claim_runs_every_example(name):
    """The README's own command, through podman where it can run: every prepared claim's
    container starts (podman reads the specs from /var/run/cdi)."""
    profile, _ = INTENT[name]
    path = REPO / "examples" / name / "claim.yaml"
    mig = ("--mig-mode", "dynamic") if name in DYNAMIC_MIG else ()
    code, out, err = _demo("--claim", str(path), "--profile", profile, *mig)
    readme = (REPO / "examples" / name / "README.md").read_text()
    if name in NEEDS_NRI:
        # allocated, then refused at prepare with one line naming the device and the switch
        assert code != 0 and "allocated: vf -> nic-" in "\n".join(out), "\n".join(out + err)
        assert any(line.startswith("dra-driver demo: claim pod-vf failed to prepare: NIC nic-")
                   and "set by the driver's NRI plugin, which is off on this node" in line for line in err), err
        assert f"dra-driver demo --claim examples/{name}/claim.yaml --profile {profile}" in readme
        return
    assert code == 0, "\n".join(out + err)
    text = "\n".join(out)
    assert "prepared:" in text and "CDI specs left: 0" in text
    if podman_ready() is None or os.environ.get("CI"):  # CI installs podman: it must run there
        assert text.count("container saw:") == text.count("prepared:"), text
    assert f"dra-driver demo --claim examples/{name}/claim.yaml --profile {profile}" in readme
    if name == "fpga-programmed":
        # the claim's function loaded at prepare, as the container (or its spec) shows
        assert re.search(r"DRA_FPGA_\w+_FUNCTION_ID=bcb4e605-a501-55d4-a198-ec86ce02d0cd$", text, re.M), text
    if name in DYNAMIC_MIG:
        assert "--mig-mode dynamic" in readme
        text = "\n".join(out)
        assert text.count("prepared:") == 5 and "pending, as its file expects" in text


def test_a_spec_the_runtime_cannot_take_names_the_version_and_the_runtime(tmp_path):
    """moveInterface writes netDevices (CDI 1.1.0), which podman 4.3 cannot read: podman
    itself says only "unresolvable CDI devices"; the demo says which runtime refused which
    version, and why the spec has it."""
    _podman_or_skip()
    moved = tmp_path / "moved.yaml"
    moved.write_text("""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: moved-vf}
spec:
  devices:
    requests:
      - {name: vf, exactly: {deviceClassName: nic.accel.dra.io}}
    config:
      - requests: [vf]
        opaque: {driver: accel.dra.io, parameters: {apiVersion: accel.dra.io/v1alpha1, kind: NicConfig,
                                                    moveInterface: true, interfaceName: net1}}
""")
    code, out, err = _demo("--claim", str(moved), "--profile", "sriov")
    text = "\n".join(out + err)
    if code == 0:  # a podman whose CDI library reads 1.1.0 specs (and moved nothing: --network none)
        return
    (line,) = [e for e in err if "the container failed" in e]
    assert line.startswith("dra-driver demo: claim moved-vf: the container failed: podman "), text
    assert "CDI spec version 1.1.0" in line and "netDevices" in line and "moveInterface" in line, line
    assert "unresolvable" not in line


def test_a_failing_claim_is_named_and_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: wrong-config}
spec:
  devices:
    requests:
      - {name: gpu, exactly: {deviceClassName: gpu.accel.dra.io}}
    config:
      - requests: [gpu]
        opaque: {driver: accel.dra.io, parameters: {apiVersion: accel.dra.io/v1alpha1, kind: NicConfig}}
""")
    cdi_root = tmp_path / "cdi"
    code, out, err = _demo("--claim", str(bad), cdi_root=cdi_root)
    assert code == 1
    assert any(e.startswith("dra-driver demo: claim wrong-config failed to prepare: ")
               and "NicConfig cannot configure gpu device" in e for e in err), err
    assert list(cdi_root.glob("*.json")) == []
    assert _driver_processes(str(cdi_root)) == []


@pytest.mark.parametrize("args, fragment", [
    (["--profile", "nosuch"], "dra-driver demo: --profile: mock profile 'nosuch' is neither a built-in"),
    (["--claim", "/nonexistent.yaml"], "dra-driver demo: --claim /nonexistent.yaml: cannot read it"),
    (["--claim", "charts/dra-accel-driver/Chart.yaml"], "no ResourceClaim or ResourceClaimTemplate"),
    (["--claim", "README.md"], "--claim README.md: not YAML: "),
])
def test_demo_usage_errors_are_one_line_and_quick(args, fragment):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "driver", "demo", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    print(f"answered in {elapsed:.2f}s")  # no waiting for a driver that cannot start


@pytest.mark.parametrize("signum, code, word", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_sigterm_and_ctrl_c_clean_up(tmp_path, signum, code, word):
    """Frozen right after a claim was prepared (its CDI spec exists), then signalled: the
    demo exits, its specs are gone, its driver process is gone, no traceback."""
    many = tmp_path / "many.yaml"
    many.write_text("\n---\n".join(
        f"apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: vf{i}}}\n"
        "spec: {devices: {requests: [{name: vf, exactly: {deviceClassName: nic.accel.dra.io}}]}}"
        for i in range(20)))
    cdi_root = tmp_path / "cdi"
    proc = subprocess.Popen([sys.executable, "-m", "driver", "demo", "--profile", "sriov", "--claim",
                             str(many), "--cdi-root", str(cdi_root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if "prepared:" in line:
            proc.send_signal(signal.SIGSTOP)
            break
    assert list(cdi_root.glob("accel.dra.io-claim_demo-*.json")), "a prepared claim's spec exists"
    assert _driver_processes(str(cdi_root)), "the driver runs"
    proc.send_signal(signum)
    proc.send_signal(signal.SIGCONT)
    rest, errors = proc.communicate(timeout=60)
    assert proc.returncode == code, errors
    assert f"interrupted ({word})" in rest or f"stopped ({word})" in rest
    assert "Traceback" not in rest + errors
    assert list(cdi_root.glob("*.json")) == []
    deadline = time.monotonic() + 10
    while _driver_processes(str(cdi_root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _driver_processes(str(cdi_root)) == []
    assert _leftovers(proc.pid) == [], "no process, mount or folder either"


def test_stale_demo_specs_are_removed_and_said(tmp_path):
    cdi_root = tmp_path / "cdi"
    cdi_root.mkdir()
    stale = cdi_root / "accel.dra.io-claim_demo-4194999-0badc0de.json"  # no such PID
    stale.write_text("{}")
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "demo"])
    alive = cdi_root / f"accel.dra.io-claim_demo-{running.pid}-0badc0de.json"  # another demo's
    alive.write_text("{}")
    real = cdi_root / "accel.dra.io-claim_5f0c7a52-8f7e-4d5b-9c1a-0b2c3d4e5f60.json"
    real.write_text("{}")  # a real driver's spec on the same host: never touched
    code, out, err = _demo("--profile", "alveo", cdi_root=cdi_root)
    assert code == 0, out + err
    assert any("removed 1 stale CDI spec(s) of an earlier demo run" in line and stale.name in line for line in out)
    assert not stale.exists() and real.exists()
    assert alive.exists(), "a demo still running keeps its specs"
    running.kill()
    running.wait()


def _leftovers(pid: int) -> list[str]:
    """What a demo of this PID left on the host: CDI specs, containers podman knows,
    containers only runc knows, conmon processes, any process that names its work folder
    (its driver, an MPS control daemon the emulated kubelet ran), mounts below that folder
    (an MPS share's shm tmpfs) and the folder itself."""
    found = [p.name for p in Path("/var/run/cdi").glob(f"accel.dra.io-claim_demo-{pid}-*.json")]
    if podman_ready() is None:
        names = subprocess.run(["podman", "ps", "--all", "--external", "--format", "{{.Names}}"],
                               capture_output=True, text=True, timeout=60).stdout.split()
        found += [n for n in names if n.startswith(f"dra-demo-{pid}-")]
        import json

        runc = subprocess.run(["runc", "list", "--format", "json"], capture_output=True, text=True,
                              timeout=60).stdout
        found += [f"runc {c['id'][:12]}" for c in json.loads(runc or "null") or []
                  if f"/dra-demo-{pid}-" in (c.get("rootfs") or "")]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if (cmdline.startswith("/usr/bin/conmon") and f" dra-demo-{pid}-" in cmdline) or \
                    f"/dra-demo-{pid}-" in cmdline:
                found.append(f"process {proc.name}: {cmdline[:80]}")
    # As the kernel lists them (octal escapes), the mount points below its work folder.
    found += [f"mount {line.split()[1]}" for line in Path("/proc/self/mounts").read_text().splitlines()
              if f"/dra-demo-{pid}-" in line.split()[1]]
    found += [f"folder {p}" for p in Path("/tmp").glob(f"dra-demo-{pid}-*")]
    return found


# Where the demo is interrupted: after this many lines of its output (0: right after its
# first line), then the signal; every phase is met (start, registration, publishing,
# allocation, prepare, a container running, unprepare, stop). The last entry of each pair
# is whether a second signal follows at once (a user pressing Ctrl-C twice).
POINTS = [(1, False), (3, True), (6, False), (12, False), (25, True), (45, False), (70, True),
          (90, False), (98, False)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_at_any_point_it_ends_at_once_cleanly(signum):
    """One Ctrl-C (to the whole process group, as a terminal sends it) or one SIGTERM, at
    many points of a run: the demo ends with no traceback, and leaves no CDI spec, no
    container (neither one podman knows nor one only runc lists), no conmon and no driver
    process. Where podman can run, containers run (the default CDI directory)."""
    word, code = ("Ctrl-C", 130) if signum == signal.SIGINT else ("SIGTERM", 143)
    for lines, twice in POINTS:
        proc = subprocess.Popen([sys.executable, "-m", "driver", "demo"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        seen = [proc.stdout.readline() for _ in range(lines)]
        os.killpg(proc.pid, signum)
        if twice:
            time.sleep(0.05)
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass
        try:
            rest, errors = proc.communicate(timeout=60)  # hangs were of minutes: not a timing
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"the demo hung after {word} at line {lines}: {''.join(seen)[-400:]}")
        where = f"{word} after {lines} line(s){' twice' if twice else ''}"
        assert "Traceback" not in rest + errors, (where, errors)
        assert proc.returncode in (code, 0), (where, proc.returncode, errors)  # 0: it had finished
        if proc.returncode == code:
            assert f"({word}); cleaned up" in rest, (where, rest[-300:])
        assert _leftovers(proc.pid) == [], where


def test_leftovers_of_a_killed_demo_are_removed_at_the_next_start(tmp_path):
    """A demo killed while podman created a container leaves it Created or Initialized
    (with its conmon and `runc init`): the next demo removes them, and says so."""
    _podman_or_skip()
    dead = 4194999  # above the kernel's PID limit: no demo runs with it
    rootfs = podman_rootfs(tmp_path / f"dra-demo-{dead}-x")
    base = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
    for n in (1, 2):
        subprocess.run(base + ["create", "--name", f"dra-demo-{dead}-{n}", "--network", "none",
                               "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
                               "--rootfs", str(rootfs), "/bin/sh", "-c", "true"],
                       check=True, capture_output=True, timeout=120)
    subprocess.run(base + ["init", f"dra-demo-{dead}-2"], check=True, capture_output=True, timeout=120)
    assert len(_leftovers(dead)) >= 3, "two containers and a conmon"
    code, out, err = _demo("--profile", "alveo")
    assert code == 0, out + err
    (said,) = [line for line in out if "container(s) of an earlier demo run" in line]
    assert f"dra-demo-{dead}-1" in said and f"dra-demo-{dead}-2" in said
    assert _leftovers(dead) == []


SHARE_A = "gpu-0000-21-00-0"  # the GPU of the mixed profile that share-a and share-b share


def _mps_daemons(pid: int) -> list[int]:
    """The MPS control daemons (`dra-driver mps-control-daemon`) of the demo of this PID."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace") if proc.name.isdigit() else ""
        except OSError:
            continue
        if "\0mps-control-daemon\0" in cmdline and f"/dra-demo-{pid}-" in cmdline:
            found.append(int(proc.name))
    return found


def _share_a_shm(pid: int) -> list[Path]:
    return list(Path("/tmp").glob(f"dra-demo-{pid}-*/state/mps/{SHARE_A}/shm"))


def _demo_at_share_a(cdi_root: Path, in_flight: bool = False) -> subprocess.Popen | None:
    """`dra-driver demo` (mixed) in a session of its own, as a terminal runs it, stopped
    (SIGSTOP) once share-a is prepared, or with `in_flight` while its NodePrepareResources
    call is in flight: the driver has made the GPU's MPS folder (and, as root, mounted its
    shm tmpfs) and the daemon is not ready yet, so the call cannot have returned. Its GPU's
    MPS control daemon (a local process of the emulated kubelet) and the driver run on.
    A CDI directory podman does not read: no containers, which this is not about. None
    where the daemon was ready before the demo could be stopped (the caller tries again)."""
    proc = subprocess.Popen([sys.executable, "-m", "driver", "demo", "--cdi-root", str(cdi_root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    step = "allocated:" if in_flight else "prepared:"
    for line in proc.stdout:
        if line.strip().startswith(step) and SHARE_A in line:
            break
    else:
        pytest.fail(f"share-a was never {step.rstrip(':')}: {proc.communicate()[1][-600:]}")
    if in_flight:
        # The demo now waits for the prepare; the driver makes the MPS folder and mounts its
        # shm before it creates the daemon's pod, then waits until the daemon is ready.
        mounted = os.path.ismount if os.geteuid() == 0 else os.path.isdir
        deadline = time.monotonic() + 60  # a hang guard, not a timing
        while not any(mounted(p) for p in _share_a_shm(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.005)
    proc.send_signal(signal.SIGSTOP)  # frozen there (its pods and driver run on)
    if in_flight and any((p.parent / "ready").exists() for p in _share_a_shm(proc.pid)):
        os.killpg(proc.pid, signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=60)
        return None
    left = _leftovers(proc.pid)
    assert in_flight or _mps_daemons(proc.pid), left
    assert any(item.startswith("folder /tmp/dra-demo-") for item in left), left
    if os.geteuid() == 0:
        assert f"mount /tmp/dra-demo-{proc.pid}-" in "\n".join(left) and \
            f"/mps/{SHARE_A}/shm" in "\n".join(left), left
    return proc


@pytest.mark.parametrize("in_flight", [True, False], ids=["share-a-preparing", "share-a-prepared"])
@pytest.mark.parametrize("signum, code, word", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_interrupted_during_an_mps_share_it_leaves_no_mount_daemon_or_folder(tmp_path, signum, code, word,
                                                                            in_flight):
    """Issue 40: Ctrl-C while share-a ran printed "cleaned up" and left the share's shm
    tmpfs mounted and the work folder behind (a prepare cut short by the signal is never
    unprepared, so the driver never stops the daemon nor unmounts). Frozen there, then
    signalled as a terminal does (the whole process group)."""
    for _ in range(3):
        proc = _demo_at_share_a(tmp_path / "cdi", in_flight)
        if proc is not None:
            break
    else:
        pytest.fail("the MPS daemon was ready each time before the demo could be stopped")
    os.killpg(proc.pid, signum)
    proc.send_signal(signal.SIGCONT)
    rest, errors = proc.communicate(timeout=60)
    assert proc.returncode == code, errors
    assert f"({word}); cleaned up" in rest and "Traceback" not in rest + errors
    assert _leftovers(proc.pid) == []


def test_a_killed_demo_s_mps_daemon_mount_and_folder_are_removed_at_the_next_start(tmp_path):
    """Issue 40: after `kill -9` during an MPS share the next start removed the stale CDI
    specs but left the orphaned MPS control daemon, its shm tmpfs and the work folder. The
    next start now removes them too, and says what it removed."""
    cdi_root = tmp_path / "cdi"
    proc = _demo_at_share_a(cdi_root)
    proc.kill()
    proc.communicate()
    assert list(cdi_root.glob(f"accel.dra.io-claim_demo-{proc.pid}-*.json"))
    code, out, err = _demo("--profile", "alveo", cdi_root=cdi_root)
    assert code == 0, out + err
    (said,) = [line for line in out if f"removed what demo run {proc.pid} (no longer running) left:" in line]
    assert "dra-driver mps-control-daemon" in said and f"its folder /tmp/dra-demo-{proc.pid}-" in said, said
    if os.geteuid() == 0:
        assert f"1 mount(s) (state/mps/{SHARE_A}/shm)" in said, said
    assert any("stale CDI spec(s)" in line for line in out)
    assert _leftovers(proc.pid) == []
    assert list(cdi_root.glob("*.json")) == []


def test_only_what_a_dead_demo_left_is_removed(tmp_path):
    """The next start's cleanup, over a folder of its own: it removes the folder of a dead
    run and stops the process that names it, and leaves alone a running demo's folder and
    process, the folder of a PID that runs but never locked one (not provably a demo's),
    the folder whose demo kept it for its log, and a process naming another folder."""
    from driver.demo import _demo_alive, killed

    dead = tmp_path / "dra-demo-4194999-x"  # above the kernel's PID limit: nothing runs with it
    kept = tmp_path / "dra-demo-4194998-y"
    other = tmp_path / "not-a-demo-4194999"
    for folder in (dead, kept, other):
        (folder / "state").mkdir(parents=True)
    (dead / killed.RUNNING).touch()
    (kept / killed.KEPT).touch()
    sleeper = [sys.executable, "-c", "import time, sys; time.sleep(60)"]
    holder = subprocess.Popen([*sleeper, "demo"])  # a `dra-driver demo` says so in its command line
    running = tmp_path / f"dra-demo-{holder.pid}-z"
    (running / "state").mkdir(parents=True)
    starting = subprocess.Popen(sleeper)  # a PID that runs, no lock taken in its folder
    unlocked = tmp_path / f"dra-demo-{starting.pid}-s"
    unlocked.mkdir()
    procs = {f: subprocess.Popen([*sleeper, str(f / "state")], start_new_session=True)
             for f in (dead, running, other)}
    try:
        removed = killed.remove(_demo_alive, tmp=tmp_path)
        assert [r.folder for r in removed] == [dead]
        (done,) = removed
        assert [p.pid for p in done.processes] == [procs[dead].pid] and done.folder_removed
        assert procs[dead].wait(timeout=10) == -signal.SIGTERM
        assert not dead.exists()
        assert kept.exists() and running.exists() and unlocked.exists() and other.exists()
        assert procs[running].poll() is None and procs[other].poll() is None
    finally:
        for p in [*procs.values(), holder, starting]:
            p.kill()
            p.wait()


def test_a_demo_run_inside_another_program_keeps_its_specs_and_containers(tmp_path):
    """A demo run in-process by a test session has no 'demo' in its command line: the lock
    on its work directory says it runs, so another demo's start leaves its things alone
    (two test sessions at once on one machine)."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, pathlib, sys, time\n"
        "work = pathlib.Path(f'/tmp/dra-demo-{os.getpid()}-held'); work.mkdir()\n"
        "f = open(work / '.running', 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('ready', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        cdi_root = tmp_path / "cdi"
        cdi_root.mkdir()
        theirs = cdi_root / f"accel.dra.io-claim_demo-{holder.pid}-0badc0de.json"
        theirs.write_text("{}")
        code, out, err = _demo("--profile", "alveo", cdi_root=cdi_root)
        assert code == 0, out + err
        assert theirs.exists(), "a running demo's spec is not stale"
    finally:
        holder.kill()
        holder.wait()
        shutil.rmtree(f"/tmp/dra-demo-{holder.pid}-held", ignore_errors=True)
