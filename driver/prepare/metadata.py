"""Device metadata inside the container (KEP-5304): what a container was given, readable
without API access (NCCL launchers, KubeVirt, a user's script).

Per claim, request and driver one file, mounted read-only through the claim's CDI spec at
  /var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json
or, for a claim made from a template, under `resourceclaimtemplates/<podClaimName>/` (the
name the pod gives the claim, from the claim's `resource.kubernetes.io/pod-claim-name`
annotation). `<request>` is the top-level request; inside, `requests[].name` keeps the
`request/subrequest` that was allocated.

The file is a JSON stream of `metadata.resource.k8s.io/v1alpha1` DeviceMetadata objects,
one per supported version, newest first (one today): the claim's identity with a
`generation` that grows with every rewrite, and per device its driver, pool, name, the
attributes as published in the ResourceSlice, and `networkData` for NICs.

The files live in the state directory, side by side as `metadata/<claim UID>_<request>.json`,
a host path the runtime can bind-mount. No directory per claim: on ext4 making and
removing two directories cost a prepare and its unprepare more CPU than everything else
they write (a directory's inode and block are allocated apart from its parent's).
Versions before 2026-12-04 wrote `metadata/<claim UID>/<request>/<driver>-metadata.json`;
such a directory is removed with its claim and swept like a file.
They are written (atomically, without fsync: see `write`) before the CDI spec that mounts
them and removed after it, so a spec never points at a missing file; a crash in between
leaves files that the retried prepare rewrites, the unprepare removes, or the sweep
removes once no record and no spec names the claim.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from driver.state import atomic

from driver.prepare import cdi

from driver.kube import names

from driver.publish import slices
from driver.state.checkpoint import PreparedDevice
from driver.prepare.claims import ClaimRef
from driver.devices.model import Device

CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
API_VERSION = "metadata.resource.k8s.io/v1alpha1"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


def pod_claim_name(claim: dict) -> str | None:
    value = ((claim.get("metadata") or {}).get("annotations") or {}).get(POD_CLAIM_ANNOTATION)
    return value if isinstance(value, str) and value else None


def container_path(ref: ClaimRef, pod_claim: str | None, request: str, driver: str) -> str:
    where = f"resourceclaimtemplates/{pod_claim}" if pod_claim else f"resourceclaims/{ref.name}"
    return f"{CONTAINER_ROOT}/{where}/{request}/{driver}-metadata.json"


@dataclass(frozen=True)
class MetadataFiles:
    root: Path  # <state-dir>/metadata
    driver: str
    owner: str  # the writing instance's token (atomic temp files)

    def path(self, uid: str, request: str) -> Path:
        # Both are DNS labels (no "_"), so the name splits back into them.
        return self.root / f"{uid}_{request}.json"

    def sweep_temp_files(self, owner_state: Callable[[str], str]) -> None:
        """Temp files of writers that died (see driver/state/atomic.py); call at start."""
        atomic.sweep_temp_files(self.root, owner_state)

    def write(self, ref: ClaimRef, pod_claim: str | None,
              devices: list[tuple[PreparedDevice, Device, dict | None]]) -> dict[str, cdi.Mount]:
        """Write one file per top-level request; returns request -> the mount for it.
        `devices`: (prepared, device as prepared, networkData or None)."""
        by_request: dict[str, list[tuple[PreparedDevice, Device, dict | None]]] = {}
        for entry in devices:
            by_request.setdefault(entry[0].request.split("/", 1)[0], []).append(entry)
        mounts = {}
        for request, entries in by_request.items():
            host = self.path(ref.uid, request)
            generation = _generation(host) + 1
            body = {
                "kind": "DeviceMetadata", "apiVersion": API_VERSION,
                "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid,
                             "generation": generation},
                **({"podClaimName": pod_claim} if pod_claim else {}),
                "requests": _requests(self.driver, entries),
            }
            # Not fsynced: after a power loss the reboot rewrites it with the spec (which lives
            # on tmpfs and is gone then); a process crash loses nothing in the page cache.
            # One line, by json's C encoder (an `indent` takes its Python one).
            atomic.write(host, (json.dumps(body) + "\n").encode(), owner=self.owner,
                         durable=False)
            mounts[request] = cdi.Mount(str(host), container_path(ref, pod_claim, request, self.driver))
        return mounts

    def remove(self, uid: str, requests: Iterable[str] | None = None) -> bool:
        """The claim's files: those of `requests` (its record's), or, without a record,
        whatever the directory holds for it. Not fsynced, like the writes."""
        if requests is None:
            return discard(self.files().get(uid, []))
        return discard([self.path(uid, request) for request in requests] + [self.root / uid])

    def files(self) -> dict[str, list[Path]]:
        """Claim UID -> its files (an older version's directory counts as one)."""
        found: dict[str, list[Path]] = {}
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return found
        for entry in entries:
            if entry.name.startswith("."):  # a temp file
                continue
            uid = entry.name.split("_", 1)[0] if entry.name.endswith(".json") else entry.name
            if not names.is_dns_label(uid):  # not ours: never named after a claim
                continue
            if entry.is_dir(follow_symlinks=False) or ("_" in entry.name and uid != entry.name):
                found.setdefault(uid, []).append(Path(entry.path))
        return found


def discard(paths: Iterable[Path]) -> bool:
    """Remove files, and an older version's directories; whether anything was there."""
    removed = False
    for path in paths:
        try:
            path.unlink()
            removed = True
        except FileNotFoundError:
            pass
        except IsADirectoryError:  # metadata/<uid>/ of a version before 2026-12-04
            shutil.rmtree(path, ignore_errors=True)
            removed = True
    return removed


def _requests(driver: str, entries) -> list[dict]:
    requests: dict[str, list[dict]] = {}
    for prepared, device, network in entries:
        body = {"driver": driver, "pool": prepared.pool, "name": prepared.device,
                "attributes": {k: slices.attribute_value(v) for k, v in sorted(device.attributes.items())}}
        if network:
            body["networkData"] = network
        requests.setdefault(prepared.request, []).append(body)
    return [{"name": name, "devices": devices} for name, devices in requests.items()]


def _generation(path: Path) -> int:
    """The generation of the file there (its first object), 0 when there is none."""
    try:
        first = json.JSONDecoder().raw_decode(path.read_text())[0]
        return int(first["metadata"]["generation"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
