"""The claims the demo allocates: built-in ones that fit the built-in profiles, or the
ResourceClaims / ResourceClaimTemplates of a YAML file (every file in examples/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from driver.prepare.opaque import API_VERSION
from driver.scheduling import claimspec


EXPECT_ANNOTATION = "accel.dra.io/demo-expect"  # "pending": the claim is meant not to fit


class ClaimFileError(ValueError):
    """A --claim file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class DemoClaim:
    name: str
    what: str
    spec: dict  # ResourceClaim spec; "{driver}" stands for the driver name
    # Built-in fallbacks run only when none of these claims could be allocated.
    instead_of: tuple[str, ...] = ()
    # Where this claim fits, for the "skipped" line (built-in claims only).
    fits: str = ""
    # The file says it cannot be allocated (annotation accel.dra.io/demo-expect: pending).
    expect_pending: bool = False
    # A claim this one is meant to share a GPU with: the header says whether it did.
    beside: str = ""


def _request(name: str, kind: str, *selectors: str) -> dict:
    exactly: dict = {"deviceClassName": f"{kind}.{{driver}}"}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": exactly}


def _share(name: str, **capacity: str) -> dict:
    request = _request(name, "gpu")
    request["exactly"]["capacity"] = {"requests": capacity}
    return request


RDMA = 'device.attributes["{driver}"].rdma == true'

BUILTIN: tuple[DemoClaim, ...] = (
    DemoClaim("gpu-nic-aligned", "a GPU and an RDMA NIC on the same PCIe root", {"devices": {
        "requests": [_request("gpu", "gpu"), _request("nic", "nic", RDMA)],
        "constraints": [{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
    }}, fits="mixed, h100x8"),
    DemoClaim("fpga-by-shell", "an FPGA whose shell matches the bitstream (Alveo U250)", {"devices": {
        "requests": [_request("fpga", "fpga",
                              'device.attributes["{driver}"].interfaceID == "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d"')],
    }}, fits="mixed, alveo"),
    DemoClaim("sriov-vf-rdma", "an SR-IOV VF with RDMA", {"devices": {
        "requests": [_request("vf", "nic", 'device.attributes["{driver}"].sriovVF == true && ' + RDMA)],
        "config": [{"requests": ["vf"], "opaque": {"driver": "{driver}", "parameters": {
            "apiVersion": API_VERSION, "kind": "NicConfig", "env": {"NCCL_IB_HCA": "auto"}}}}],
    }}, fits="mixed, sriov, sriov-large"),
    DemoClaim("mig-slice", "one MIG device", {"devices": {"requests": [_request("mig", "mig")]}},
              fits="a100-mig"),
    # Two claims packed onto one GPU, each with its own memory and compute limit (MPS).
    DemoClaim("share-a", "20Gi and 30% of a GPU", {"devices": {"requests": [
        _share("gpu", memory="20Gi", compute="30")]}}, fits="mixed, h100x8, l4"),
    DemoClaim("share-b", "30Gi and 50% of a GPU", {"devices": {"requests": [
        _share("gpu", memory="30Gi", compute="50")]}}, fits="mixed, h100x8", beside="share-a"),
    # Fallbacks, so that every profile shows something of each kind it has.
    DemoClaim("one-gpu", "one GPU", {"devices": {"requests": [_request("gpu", "gpu")]}},
              instead_of=("gpu-nic-aligned",)),
    DemoClaim("one-fpga", "one FPGA", {"devices": {"requests": [_request("fpga", "fpga")]}},
              instead_of=("fpga-by-shell",)),
    DemoClaim("one-nic", "one NIC", {"devices": {"requests": [_request("nic", "nic")]}},
              instead_of=("gpu-nic-aligned", "sriov-vf-rdma")),
)


def fill(obj, driver: str):
    if isinstance(obj, str):
        return obj.replace("{driver}", driver)
    if isinstance(obj, list):
        return [fill(x, driver) for x in obj]
    if isinstance(obj, dict):
        return {k: fill(v, driver) for k, v in obj.items()}
    return obj


def yaml_problem(err: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own message spans several lines)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


def from_file(path: Path) -> tuple[list[DemoClaim], dict[str, list[str]]]:
    """The claims of a YAML file (ResourceClaims and ResourceClaimTemplates, in order) and
    the CEL selectors of any DeviceClasses it defines."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as err:
        raise ClaimFileError(f"--claim {path}: cannot read it: {err.strerror or err}") from err
    except yaml.YAMLError as err:
        raise ClaimFileError(f"--claim {path}: not YAML: {yaml_problem(err)}") from err
    claims: list[DemoClaim] = []
    classes: dict[str, list[str]] = {}
    for index, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ClaimFileError(f"--claim {path}: document {index + 1} is not an object")
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name", f"document-{index + 1}")
        spec = doc.get("spec") or {}
        if kind in claimspec.CLAIM_KINDS:
            # As the API server takes it (v1beta1 and v1beta2 converted to v1), or its error.
            try:
                converted = claimspec.convert(doc)
            except claimspec.ClaimSpecError as err:
                raise ClaimFileError(f"--claim {path}: {err}") from None
            spec = converted.spec if kind == "ResourceClaim" else {**spec, "spec": converted.spec}
        annotations = (doc.get("metadata") or {}).get("annotations") or {}
        pending = annotations.get(EXPECT_ANNOTATION) == "pending"
        if kind == "ResourceClaim":
            claims.append(DemoClaim(name, f"ResourceClaim from {path.name}", spec,
                                    expect_pending=pending))
        elif kind == "ResourceClaimTemplate":
            claims.append(DemoClaim(name, f"ResourceClaimTemplate from {path.name}",
                                    spec.get("spec") or {}, expect_pending=pending))
        elif kind == "DeviceClass":
            try:
                claimspec.check_class(doc)
            except claimspec.ClaimSpecError as err:
                raise ClaimFileError(f"--claim {path}: {err}") from None
            classes[name] = [s["cel"]["expression"] for s in spec.get("selectors") or [] if "cel" in s]
    if not claims:
        raise ClaimFileError(f"--claim {path}: no ResourceClaim or ResourceClaimTemplate in it")
    for claim in claims:
        if not isinstance(claim.spec.get("devices"), dict) or not claim.spec["devices"].get("requests"):
            raise ClaimFileError(f"--claim {path}: claim {claim.name} has no spec.devices.requests")
    return claims, classes
