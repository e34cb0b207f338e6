"""The README's demo runs end to end (with a real container where podman can run)."""

from __future__ import annotations

import os
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
    containers only runc knows, conmon processes, and its driver process."""
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
                    f"/dra-demo-{pid}-" in cmdline and " run " in cmdline and "--mock" in cmdline:
                found.append(f"process {proc.name}: {cmdline[:80]}")
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
