"""`dra-driver demo`: the whole driver on this machine, no cluster, no hardware.

Starts the API server emulator, runs `dra-driver run --mock <profile>` as a real process,
registers it with a fake kubelet, allocates claims with the DeviceClass and claim CEL
selectors (built-in ones that fit the profile, or those of `--claim FILE`), prepares them
over the kubelet's gRPC protocol, starts a podman container with the returned CDI devices
where podman can run (root, podman, runc, busybox-static), prints what the container saw,
then unprepares and stops.

It leaves the host as it found it. CDI specs go to the real /var/run/cdi only when podman
runs (podman reads them there); the demo's claims have UIDs `demo-<pid>-<uuid>`, so their
specs (`<driver>-claim_demo-*.json`) are recognisably the demo's. They are removed on
success, on failure, on Ctrl-C and on SIGTERM; at start, those of earlier demos that are
no longer running (the PID in the name) are removed. So are containers: named
`dra-demo-<pid>-<n>`, with their rootfs in `/tmp/dra-demo-<pid>-*/`, so that those of a
killed demo are found at the next start even where podman itself lost track of them
(killed while creating one: only `runc list` shows it). An MPS share's shm tmpfs, which
the driver releases only when it stops the GPU's daemon, is unmounted when the demo ends
however it ends; what a killed demo left in its work folder (MPS daemons, mounts, the
folder) goes at the next start (driver/demo/killed.py). The driver process and podman run
in their own sessions, so that the terminal's Ctrl-C reaches only the demo, which
unprepares through the driver and then stops it; the driver still dies with the demo.

One signal ends the demo within seconds; later ones are ignored, so that they cannot cut
the cleanup short. A signal that comes during a gRPC call is acted on after it: raised
inside gRPC's code, it left a call whose finalizer then waited forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from driver import needs_demo_extra
from driver.publish import deviceclasses, slices

from driver.kube import quantity
from driver.demo import killed, podman
from driver.demo.claims import BUILTIN, ClaimFileError, DemoClaim, fill, from_file
from driver.devices.model import Device, DeviceKind, Inventory
from driver.prepare import shm

NODE = "demo-node"
UID_PREFIX = "demo-"
SYSTEM_CDI = Path("/var/run/cdi")
EXIT_USAGE = 2
_LIBC = ctypes.CDLL(None, use_errno=True)


class Stopped(BaseException):
    """Ctrl-C or SIGTERM: unwind through the cleanup (a BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


_pending: list[int] = []  # a signal that came during a gRPC call, acted on after it
_in_grpc = threading.local()


def _stop(signum, frame) -> None:
    # One signal is enough: the cleanup it starts is bounded. Later ones (a second Ctrl-C)
    # must not interrupt that cleanup half-way, nor print a traceback.
    for other in STOP_SIGNALS:
        signal.signal(other, _ignore)
    if getattr(_in_grpc, "depth", 0):
        # An exception raised inside gRPC's code leaves a call whose __del__ then waits
        # forever (seen: "interrupted; cleaned up", then a hang at exit). Note it; the
        # waiting loop below raises it outside gRPC.
        _pending.append(signum)
        return
    raise Stopped(signum)


@contextlib.contextmanager
def _grpc():
    """gRPC calls: a signal that comes meanwhile is raised after the call, not inside it."""
    _in_grpc.depth = getattr(_in_grpc, "depth", 0) + 1
    try:
        yield
    finally:
        _in_grpc.depth -= 1
    if _pending and not _in_grpc.depth:
        raise Stopped(_pending.pop())


def _await(future):
    """The result of a gRPC future, waited for in short steps: a signal cancels it."""
    import grpc

    while True:
        try:
            return future.result(timeout=0.1)
        except grpc.FutureTimeoutError:
            if _pending:
                future.cancel()
                raise Stopped(_pending.pop()) from None


def _ignore(signum, frame) -> None:
    pass


def _die_with_parent() -> None:
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphaned driver if we are killed


def demo_specs(cdi_root: Path, driver: str) -> list[Path]:
    return sorted(cdi_root.glob(f"{driver}-claim_{UID_PREFIX}*.json"))


def _running_demo(spec: Path, driver: str) -> bool:
    """Does the demo that wrote this spec still run (another terminal's demo)?"""
    uid = spec.name.removeprefix(f"{driver}-claim_").removesuffix(".json")
    pid = uid.removeprefix(UID_PREFIX).split("-", 1)[0]
    return pid.isdigit() and _demo_alive(int(pid))


RUNNING = killed.RUNNING  # in the work directory, locked while that demo runs


def _demo_alive(pid: int) -> bool:
    """Is process `pid` another demo that still runs (not this one, not a recycled PID)?
    A `dra-driver demo` says so in its command line; a demo run inside another program
    (a test session) by the lock it holds on its work directory's RUNNING file."""
    if pid == os.getpid():
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if b"demo" in cmdline:
        return True
    for marker in Path("/tmp").glob(f"dra-demo-{pid}-*/{RUNNING}"):
        try:
            with open(marker) as held:
                fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            continue
    return False


@dataclass
class Demo:
    profile: str
    driver: str
    out: Callable[[str], None]
    err: Callable[[str], None]
    claims: list[DemoClaim] = field(default_factory=list)
    extra_classes: dict[str, list[str]] = field(default_factory=dict)
    from_file: bool = False
    claim_file: Path | None = None  # --claim FILE, for the hints of a claim that does not fit
    # /tmp/dra-demo-<pid>-*: a container's rootfs is in it, which says whose container it is.
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix=f"dra-demo-{os.getpid()}-",
                                                                     dir="/tmp")))
    proc: subprocess.Popen | None = None
    cdi_root: Path = SYSTEM_CDI
    why_no_container: str | None = None
    ours: list[str] = field(default_factory=list)  # UIDs of the claims we created
    mig_mode: str = "static"
    containers: int = 0  # how many containers were started (they are named dra-demo-<pid>-<n>)

    @property
    def log_file(self) -> Path:
        return self.work / "driver.log"

    # -- the driver process ----------------------------------------------------------------
    def start_driver(self, api) -> None:
        args = [sys.executable, "-m", "driver", "run", "--node-name", NODE, "--driver-name", self.driver,
                "--mock", self.profile, "--kubeconfig", str(api.kubeconfig(self.work)),
                "--kubelet-registrar-dir", str(self.work / "registry"),
                "--kubelet-plugins-dir", str(self.work / "plugins"), "--cdi-root", str(self.cdi_root),
                "--state-dir", str(self.work / "state"), "--metrics-port", "0", "--healthz-port", "0",
                "--log-format", "json",
                # Whole GPUs are published as shareable: a claim that asks for part of one
                # gets a share under the GPU's MPS daemon (run by the pod runner); its limits are
                # per-process MPS settings, not enforced (docs/sharing.md).
                "--gpu-sharing", "consumable", "--mps-image", "dra-accel-driver:demo",
                "--namespace", "default", "--mig-mode", self.mig_mode]
        with open(self.log_file, "wb") as log:
            # Its own session: the terminal's Ctrl-C goes to the demo, which unprepares
            # through the driver and then stops it; it still dies with the demo.
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent, start_new_session=True)

    def wait_for_registration_socket(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        registry = self.work / "registry"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the driver exited with code {self.proc.returncode}: {self.driver_error()}")
            if any(not p.name.startswith(".") for p in registry.glob("*.sock")):
                return
            time.sleep(0.02)
        raise RuntimeError(f"the driver did not register within {timeout:g}s; log: {self.log_file}")

    def driver_error(self) -> str:
        """The driver's own last words: its one-line error, or its last log event."""
        try:
            lines = [ln for ln in self.log_file.read_text().splitlines() if ln.strip()]
        except OSError:
            return "(no output)"
        for line in reversed(lines):
            if line.startswith("dra-driver:"):
                return line.removeprefix("dra-driver: ")
        return lines[-1] if lines else "(no output)"

    def stop_driver(self, grace: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    # -- the host's CDI directory ----------------------------------------------------------
    def remove_stale_specs(self) -> None:
        stale = [p for p in demo_specs(self.cdi_root, self.driver) if not _running_demo(p, self.driver)]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            self.out(f"== removed {len(stale)} stale CDI spec(s) of an earlier demo run from "
                     f"{self.cdi_root}: {', '.join(p.name for p in stale)}")
        if self.why_no_container is None:
            containers = podman.leftovers(_demo_alive)
            if containers:
                self.out(f"== removed {len(containers)} container(s) of an earlier demo run: "
                         f"{', '.join(containers)}")
        # After the containers (their rootfs is in those folders): the MPS daemons, shm
        # mounts and work folders of killed runs.
        for removed in killed.remove(_demo_alive):
            self.out(f"== {removed.describe()}")

    def remove_our_specs(self) -> int:
        removed = 0
        for uid in self.ours:
            path = self.cdi_root / f"{self.driver}-claim_{uid}.json"
            if path.exists():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    # -- the demo --------------------------------------------------------------------------
    def run(self, Unsatisfiable, allocate, allocation_config, allocation_results) -> int:
        from driver.sim.apiserver import ApiServer, claim_allocated
        from driver.sim.kubelet import Claim, FakeKubelet
        from driver.sim.pods import PodRunner

        self.why_no_container = podman.ready()
        if self.cdi_root not in podman.SPEC_DIRS and self.why_no_container is None:
            self.why_no_container = f"podman does not read CDI specs from {self.cdi_root}"
        if self.cdi_root == SYSTEM_CDI and self.why_no_container is not None:
            self.cdi_root = self.work / "cdi"  # no container to give them to: keep them private
        keep_log = False
        kubelet = None
        prepared: list[Claim] = []
        running = open(self.work / RUNNING, "w")  # noqa: SIM115 (held until the end)
        fcntl.flock(running, fcntl.LOCK_EX)
        try:
            with ApiServer() as api, PodRunner(api, NODE, self.work / "pods"):
                try:
                    api.add_node(NODE)
                    self.out(f"== API server emulator at {api.url}; driver state in {self.work}")
                    self.remove_stale_specs()
                    self.start_driver(api)
                    try:
                        self.wait_for_registration_socket()
                    except RuntimeError as error:
                        self.err(f"dra-driver demo: {error}")
                        keep_log = True
                        return 1
                    kubelet = FakeKubelet(self.work / "registry")
                    with _grpc():
                        info = kubelet.register()
                    self.out(f"== kubelet: registered {info.name} ({', '.join(info.supported_versions)}), "
                             f"talking {kubelet.version}")
                    api.wait_for(lambda: bool(api.state.slices), timeout=30)
                    time.sleep(0.3)
                    stored = api.slices()
                    inventory, shares, counters, device_taints = _inventory_from_slices(stored, self.driver)
                    order = _scheduler_order(stored)
                    self.out(f"== published {len(inventory.devices)} devices in {len(stored)} ResourceSlices "
                             f"(pool {NODE}, generation {stored[0]['spec']['pool']['generation']})")
                    classes = {**deviceclasses.all_classes(self.driver), **self.extra_classes}
                    rootfs = podman.busybox_rootfs(self.work) if self.why_no_container is None else None
                    taken: set[str] = set()
                    ran: set[str] = set()
                    skipped: list[str] = []
                    placed: dict[str, set[str]] = {}  # claim -> its devices
                    problems: list[str] = []
                    unplaced: list[str] = []  # claims of --claim FILE that did not fit
                    for claim in self.claims:
                        if claim.instead_of and ran & set(claim.instead_of):
                            continue
                        spec = fill(claim.spec, self.driver)
                        try:
                            choices = allocate(spec, inventory, classes, self.driver, taken, shares,
                                               counters, device_taints, order=order)
                        except Unsatisfiable as error:
                            if claim.expect_pending:
                                self.out(f"\n== claim {claim.name}: {claim.what}\n   pending, as "
                                         f"its file expects: {error}")
                                continue
                            if self.from_file:
                                unplaced.append(f"claim {claim.name} cannot be allocated on profile "
                                                f"{self.profile}: {error}; "
                                                + self.where_it_fits(spec, classes, allocate, Unsatisfiable))
                                self.out(f"\n== claim {claim.name}: {claim.what}\n   not allocated: {error}")
                            elif not claim.instead_of and self.profile in claim.fits.split(", "):
                                # Meant for this profile, yet it does not fit (another
                                # --mig-mode, say): the allocator's reason, not the hint.
                                why = str(error)
                                if self.mig_mode == "dynamic":
                                    why = (f"it fits {self.profile} with --mig-mode static; in dynamic "
                                           "mode the driver leaves MIG devices it did not create alone "
                                           f"and publishes none of them: {error}")
                                skipped.append(f"{claim.name} ({why})")
                            elif not claim.instead_of:
                                skipped.append(f"{claim.name} (fits {claim.fits})")
                            continue
                        ran.add(claim.name)
                        results = allocation_results(choices, self.driver, NODE)
                        taken |= {r["device"] for r in results if "shareID" not in r}
                        ref = Claim("default", claim.name, f"{UID_PREFIX}{os.getpid()}-{uuid.uuid4()}")
                        self.ours.append(ref.uid)
                        api.put_claim(claim_allocated(ref.namespace, ref.name, ref.uid, results,
                                                      allocation_config(spec, self.driver)))
                        placed[claim.name] = {r["device"] for r in results}
                        self.out(f"\n== claim {claim.name}: {claim.what}{_beside(claim, placed)}")
                        self.out("   allocated: " + ", ".join(f"{r['request']} -> {r['device']}{_share(r)}"
                                                         for r in results))
                        with _grpc():
                            entry = _await(kubelet.future("NodePrepareResources", [ref])).claims[ref.uid]
                        if entry.error:
                            problems.append(f"claim {claim.name} failed to prepare: {entry.error}")
                            self.out(f"   prepare failed: {entry.error}")
                            continue
                        prepared.append(ref)
                        cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
                        self.out("   prepared: " + ", ".join(cdi_ids))
                        self.show(rootfs, ref, cdi_ids, problems, claim.name)
                    if skipped:
                        mode = " with --mig-mode dynamic" if self.mig_mode == "dynamic" else ""
                        self.out(f"\n== not on profile {self.profile}{mode}: {', '.join(skipped)}")
                    self.out("")
                    if not ran and not unplaced:
                        problems.append(f"no claim fits profile {self.profile}")
                    unprepared = 0
                    for ref in list(prepared):
                        with _grpc():
                            entry = _await(kubelet.future("NodeUnprepareResources", [ref])).claims[ref.uid]
                        if entry.error:
                            problems.append(f"claim {ref.name} failed to unprepare: {entry.error}")
                        else:
                            prepared.remove(ref)
                            unprepared += 1
                    left = [p.name for p in self.cdi_root.glob(f"{self.driver}-claim_*.json")
                            if any(uid in p.name for uid in self.ours)]
                    self.out(f"== unprepared {unprepared} claims; CDI specs left: {len(left)}")
                    with _grpc():
                        kubelet.close()
                    kubelet = None
                    code = self.stop_driver()
                    self.out(f"== driver stopped (exit {code}); {len(api.slices())} slices stay published "
                             "for the next instance")
                    if code != 0:
                        problems.append(f"the driver exited with code {code}: {self.driver_error()}")
                    if left:
                        problems.append(f"CDI specs left behind: {', '.join(left)}")
                    for problem in unplaced + problems:
                        self.err(f"dra-driver demo: {problem}")
                    # A claim that does not fit is the claim's story, told above; the
                    # driver's log only matters when the driver or a prepare failed.
                    keep_log = bool(problems)
                    return 1 if problems or unplaced else 0
                finally:
                    # Interrupted or failed: every step bounded, so that the demo ends within seconds.
                    if kubelet is not None and prepared:
                        try:
                            with _grpc():
                                _await(kubelet.future("NodeUnprepareResources", prepared, timeout=5))
                        except Exception:  # the driver may be gone: the spec removal below covers it
                            pass
                    if kubelet is not None:
                        with _grpc():
                            kubelet.close()
                    self.stop_driver(grace=5)
        finally:
            self.remove_our_specs()
            # The node is down (its pods' processes ended): an MPS share's shm tmpfs that the
            # driver had no time to release (Ctrl-C) would keep the folder and its mount.
            shm.release_all_under(self.work)
            running.close()
            if keep_log:
                (self.work / killed.KEPT).touch()  # the next start leaves it to the user
                self.err(f"dra-driver demo: driver log kept in {self.log_file}")
            else:
                shutil.rmtree(self.work, ignore_errors=True)

    def where_it_fits(self, spec: dict, classes: dict, allocate, Unsatisfiable) -> str:
        """Where to go from a claim that does not fit: explain's command for the why, and
        the built-in profiles whose node (as the demo publishes it) can hold the claim."""
        from driver.devices.mock import builtin_profiles
        from driver.publish.mocknode import mock_objects

        fits = []
        for profile in builtin_profiles():
            # sriov-large is sriov at scale (2,048 VFs): its fake tree alone takes ~1 min to
            # build, for an answer the sriov profile gives.
            if profile in (self.profile, "sriov-large"):
                continue
            stored = [o for o in mock_objects(profile, self.driver, slices.CONSUMABLE, self.mig_mode)
                      if o.get("kind") == "ResourceSlice"]
            inventory, shares, counters, taints = _inventory_from_slices(stored, self.driver)
            try:
                allocate(spec, inventory, classes, self.driver, set(), shares, counters, taints,
                         order=_scheduler_order(stored))
            except Unsatisfiable:
                continue
            fits.append(profile)
        file = self.claim_file or "FILE"
        mode = " --mig-mode dynamic" if self.mig_mode == "dynamic" else ""
        why = f"`dra-driver explain -f {file} --mock {self.profile}{mode}` says why"
        if not fits:
            return f"{why}; no built-in profile can hold it"
        return (f"{why}; it fits profile{'s' if len(fits) > 1 else ''} {', '.join(fits)} "
                f"(`dra-driver demo --claim {file} --profile {fits[0]}{mode}`)")

    def show(self, rootfs: Path | None, ref, cdi_ids: list[str], problems: list[str], name: str) -> None:
        if rootfs is not None:
            seen = podman.run(rootfs, cdi_ids, name=self.container_name())
            if seen.returncode != 0:
                why = seen.stderr.strip()
                if "unresolvable CDI devices" in why:
                    why = self.unresolvable(rootfs, ref, cdi_ids) or why
                problems.append(f"claim {name}: the container failed: {why}")
                self.out(f"   container failed: {why}")
                return
            self.out("   container saw:")
            for line in seen.stdout.splitlines():
                self.out(f"     {line}")
            return
        spec_file = self.cdi_root / f"{self.driver}-claim_{ref.uid}.json"
        edits = [d["containerEdits"] for d in json.loads(spec_file.read_text())["devices"]]
        self.out(f"   (no container: {self.why_no_container}) CDI spec {spec_file.name}:")
        for e in edits:
            self.out(f"     nodes {[n['path'] for n in e.get('deviceNodes', [])]}")
            limits = [v for v in e.get("env", []) if v.startswith("CUDA_MPS_")]
            if limits:
                self.out(f"     MPS {' '.join(sorted(limits))}")
            # what an FPGA's region holds after prepare loaded the claim's function
            functions = [v for v in e.get("env", []) if v.startswith("DRA_FPGA_") and "_FUNCTION_ID=" in v]
            if functions:
                self.out(f"     FPGA {' '.join(sorted(functions))}")


    def container_name(self) -> str:
        self.containers += 1
        return f"{podman.CONTAINER_PREFIX}{os.getpid()}-{self.containers}"

    def unresolvable(self, rootfs: Path, ref, cdi_ids: list[str]) -> str | None:
        """podman says only "unresolvable CDI devices": say which spec version it refused,
        and what in the spec needs that version."""
        spec_file = self.cdi_root / f"{self.driver}-claim_{ref.uid}.json"
        try:
            spec = json.loads(spec_file.read_text())
        except (OSError, ValueError):
            return None
        version = str(spec.get("cdiVersion"))
        refused = podman.refused_spec(rootfs, cdi_ids, spec_file, version, self.container_name())
        if refused is None:
            return None
        used = sorted({key for d in spec.get("devices", []) for key in d.get("containerEdits", {})
                       if key in podman.NEWER_FIELDS})
        needs = f" for {', '.join(podman.NEWER_FIELDS[k] for k in used)}" if used else ""
        return (f"{podman.version()} cannot take CDI spec version {version} ({refused}): the spec "
                f"{spec_file.name} declares cdiVersion {version}{needs}")



def main(profile: str = "mixed", driver: str = "accel.dra.io", out: Callable[[str], None] = print,
         claim_file: Path | None = None, err: Callable[[str], None] | None = None,
         cdi_root: Path | None = None, mig_mode: str = "static") -> int:
    err = err or (lambda line: print(line, file=sys.stderr))
    _pending.clear()
    previous = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}
    try:
        return _main(profile, driver, out, claim_file, err, cdi_root, mig_mode)
    except Stopped as stop:
        if stop.signum == signal.SIGINT:
            out("\n== interrupted (Ctrl-C); cleaned up")
            return 130
        out("\n== stopped (SIGTERM); cleaned up")
        return 143
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _main(profile: str, driver: str, out: Callable[[str], None], claim_file: Path | None,
          err: Callable[[str], None], cdi_root: Path | None, mig_mode: str) -> int:
    try:
        from driver.scheduling.allocator import Unsatisfiable, allocate, allocation_config, allocation_results
    except ImportError as error:
        if error.name not in ("celpy", "lark"):
            raise
        err(needs_demo_extra("demo", error.name))
        return EXIT_USAGE
    from driver.devices.mock import ProfileError
    from driver.devices.mock import load as load_profile

    try:
        load_profile(profile)
    except ProfileError as error:
        err(f"dra-driver demo: --profile: {error}")
        return EXIT_USAGE
    claims, classes = list(BUILTIN), {}
    if claim_file is not None:
        try:
            claims, classes = from_file(claim_file)
        except ClaimFileError as error:
            err(f"dra-driver demo: {error}")
            return EXIT_USAGE

    demo = Demo(profile, driver, out, err, claims, classes, from_file=claim_file is not None,
                claim_file=claim_file,
                cdi_root=cdi_root or SYSTEM_CDI, mig_mode=mig_mode)
    return demo.run(Unsatisfiable, allocate, allocation_config, allocation_results)


def _beside(claim: DemoClaim, placed: dict[str, set[str]]) -> str:
    """', beside share-a' when it landed on share-a's GPU; else where it went instead."""
    if not claim.beside or claim.beside not in placed:
        return ""
    if placed[claim.name] & placed[claim.beside]:
        return f", beside {claim.beside}"
    return f", on another GPU than {claim.beside} (no room left beside it)"


def _share(result: dict) -> str:
    """' (share: compute 30%, memory 20Gi)'. A claim that asked for no compute reserves none
    (its default is 0), which 'compute 0' would have read as a share of nothing."""
    consumed = result.get("consumedCapacity")
    if not consumed:
        return ""
    parts = []
    for key, value in sorted(consumed.items()):
        if key == "compute":
            parts.append("no compute reserved" if quantity.value(value) == 0 else f"compute {value}%")
        else:
            parts.append(f"{key} {value}")
    return " (share: " + ", ".join(parts) + ")"


def _scheduler_order(stored: list[dict]) -> list[str]:
    """The device names in the order the scheduler visits them: pools by name, a pool's
    slices by name, a slice's devices as listed (the first fitting ones are those it picks)."""
    ordered = sorted(stored, key=lambda o: (o["spec"]["pool"]["name"], o["metadata"]["name"]))
    return [d["name"] for o in ordered for d in o["spec"].get("devices", [])]


def _inventory_from_slices(stored: list[dict], driver: str):
    """Devices as the scheduler sees them: from the published slices, not from discovery;
    the capacity of those that allow multiple allocations, the counters, and the taints."""
    from driver.devices.model import Version
    from driver.scheduling.allocator import Counters, Shares

    devices = []
    shares = Shares()
    counters = Counters()
    device_taints: dict[str, list[dict]] = {}
    for obj in stored:
        for counter_set in obj["spec"].get("sharedCounters") or []:
            counters.totals[counter_set["name"]] = {
                k: quantity.value(v["value"]) for k, v in counter_set["counters"].items()}
        for d in obj["spec"].get("devices", []):
            if d.get("consumesCounters"):
                counters.consumes[d["name"]] = {
                    use["counterSet"]: {k: quantity.value(v["value"]) for k, v in use["counters"].items()}
                    for use in d["consumesCounters"]}
            if d.get("allowMultipleAllocations"):
                shares.capacity[d["name"]] = d.get("capacity", {})
            if d.get("taints"):
                device_taints[d["name"]] = list(d["taints"])
            attrs = {}
            for key, value in d.get("attributes", {}).items():
                (kind, v), = value.items()
                attrs[key] = Version(v) if kind == "version" else v
            kind = DeviceKind(attrs["type"])
            devices.append(Device(d["name"], kind, attrs,
                                  {k: c["value"] for k, c in d.get("capacity", {}).items()}))
    return Inventory(tuple(devices)), shares, counters, device_taints
