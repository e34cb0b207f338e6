"""ResourceClaims from the API server, and what their allocation asks of this driver."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from driver.kube import names
from driver.kube.client import ApiError, Kube, NotFound
from driver.kube.asyncclient import LoopGets
from driver.kube.client import API_GROUP


class ClaimError(Exception):
    """Preparing one claim failed; the message is what the kubelet shows (names the claim)."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    def check(self) -> None:
        """Refuse references that are not Kubernetes names before they touch a file path."""
        if not names.is_dns_label(self.uid):
            raise ClaimError(f"claim {self}: UID {self.uid!r} is not a valid UID")
        if not names.is_dns_label(self.namespace):
            raise ClaimError(f"claim {self}: namespace {self.namespace!r} is invalid")
        if not names.is_dns_subdomain(self.name):
            raise ClaimError(f"claim {self}: name {self.name!r} is invalid")


@dataclass(frozen=True)
class AllocatedDevice:
    request: str
    pool: str
    device: str
    share_id: str | None
    admin_access: bool = False
    consumed: dict = field(default_factory=dict)  # consumedCapacity, as the server wrote it


@dataclass(frozen=True)
class OpaqueConfig:
    """One of this driver's opaque configs of the allocation."""
    source: str  # FromClass or FromClaim
    requests: tuple[str, ...]  # empty: every request of the claim
    parameters: Any
    # The claim's author named requests for it: a device it cannot configure is a mistake
    # to report, not a device of another kind that a claim-wide config leaves alone.
    aimed: bool


@dataclass(frozen=True)
class Allocation:
    devices: tuple[AllocatedDevice, ...]
    configs: tuple[OpaqueConfig, ...]  # this driver's, class ones first


def allocation_for(claim: dict, ref: ClaimRef, driver: str) -> Allocation:
    """The parts of a claim's allocation that belong to this driver."""
    uid = claim.get("metadata", {}).get("uid")
    if uid != ref.uid:
        raise ClaimError(f"claim {ref}: UID is {uid}, the kubelet asked for {ref.uid} "
                         "(the claim was deleted and re-created)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref} is not allocated")
    devices = (allocation.get("devices") or {})
    results = [r for r in devices.get("results") or [] if r.get("driver") == driver]
    if not results:
        raise ClaimError(f"claim {ref} has no devices allocated by driver {driver}")
    allocated = []
    for r in results:
        consumed = r.get("consumedCapacity") or {}
        if not isinstance(consumed, dict) or not all(isinstance(v, (str, int)) for v in consumed.values()):
            raise ClaimError(f"claim {ref}: consumedCapacity of device {r.get('device')} is not a "
                             "map of quantities")
        share_id = r.get("shareID")
        if share_id is not None and not (isinstance(share_id, str) and names.is_dns_label(share_id)):
            raise ClaimError(f"claim {ref}: shareID {share_id!r} of device {r.get('device')} is "
                             "not a UID")
        allocated.append(AllocatedDevice(str(r.get("request", "")), str(r.get("pool", "")),
                                         str(r.get("device", "")), share_id,
                                         r.get("adminAccess") is True,
                                         {str(k): str(v) for k, v in consumed.items()}))
    allocated = tuple(allocated)
    entries = [c for c in devices.get("config") or [] if (c.get("opaque") or {}).get("driver") == driver]
    # Class configs first, claim configs after: later entries win (stable within a source).
    entries.sort(key=lambda c: 0 if c.get("source") == "FromClass" else 1)
    unnamed = _unnamed_in_spec(claim, driver, devices.get("results") or [])
    configs = []
    for entry in entries:
        requests = tuple(entry.get("requests") or ())
        # A class config's requests are the scheduler's bookkeeping (the requests of the
        # class), never a choice of the claim's author: it applies to the devices it can.
        aimed = False
        if entry.get("source") != "FromClass":
            if not requests:
                match = next((i for i, c in enumerate(unnamed) if c.get("opaque") == entry["opaque"]), None)
                if match is not None:  # the spec's entry, and those before it are passed
                    requests = tuple(unnamed[match].get("requests") or ())
                    del unnamed[:match + 1]
            aimed = bool(requests)
        configs.append(OpaqueConfig(str(entry.get("source", "")), requests,
                                    entry["opaque"].get("parameters"), aimed))
    return Allocation(allocated, tuple(configs))


def _unnamed_in_spec(claim: dict, driver: str, results: list[dict]) -> list[dict]:
    """The claim's configs for `driver` that the allocation shows without `requests`, as
    the claim's spec (immutable) has them, in order.

    The scheduler clears `requests` of every config that names all of the claim's requests
    (or their chosen subrequests, `req/sub`): "empty means all" (k8s.io/dynamic-resource-
    allocation structured/internal/*/allocator_*.go). Taken as claim-wide, a GpuConfig
    aimed at a one-request claim's FPGA would be skipped in silence. The spec's configs
    that name no request or all of them are exactly those entries, each copied in the
    spec's order, so they pair up in order (their `opaque` must agree)."""
    spec = (claim.get("spec") or {}).get("devices") or {}
    names = [r.get("name") for r in spec.get("requests") or [] if isinstance(r, dict)]
    chosen = {str(r.get("request", "")).split("/", 1)[0]: str(r.get("request", ""))
              for r in results if "/" in str(r.get("request", ""))}

    def names_all(requests: list) -> bool:
        return all(n in requests or chosen.get(n) in requests for n in names)

    return [c for c in spec.get("config") or [] if isinstance(c, dict)
            and (c.get("opaque") or {}).get("driver") == driver
            and (not c.get("requests") or (isinstance(c["requests"], list) and names_all(c["requests"])))]


class ClaimReader:
    """GETs claims with the newest resource.k8s.io version the API server serves: `read`
    on the event loop (Prepare's path, driver/kube/asyncclient.py), `get` from a thread."""

    def __init__(self, kube: Kube, connections: int = 16) -> None:
        self.kube = kube
        self.gets = LoopGets(kube, connections)

    def get(self, ref: ClaimRef) -> dict:
        with _claim_errors(ref):
            return self.kube.request("GET", self._path(ref, self.kube.resource_version()))

    async def read(self, ref: ClaimRef) -> dict:
        with _claim_errors(ref):
            version = self.kube.known_resource_version()
            if version is None:  # asked once, then known
                version = await asyncio.to_thread(self.kube.resource_version)
            return await self.gets.get(self._path(ref, version))

    async def read_pod(self, namespace: str, name: str) -> dict | None:
        """A pod a claim is reserved for (None once it is gone)."""
        try:
            return await self.gets.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        except NotFound:
            return None
        except ApiError as err:
            raise ClaimError(f"pod {namespace}/{name}: cannot read it: {err}") from err

    @staticmethod
    def _path(ref: ClaimRef, version: str) -> str:
        return f"/apis/{API_GROUP}/{version}/namespaces/{ref.namespace}/resourceclaims/{ref.name}"


@contextlib.contextmanager
def _claim_errors(ref: ClaimRef) -> Iterator[None]:
    try:
        yield
    except NotFound as err:
        raise ClaimError(f"claim {ref} not found") from err
    except ApiError as err:
        raise ClaimError(f"claim {ref}: cannot read it from the API server: {err}") from err
