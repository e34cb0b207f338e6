"""Where `explain` reads the cluster and the claim from.

- files (`--slices FILE`, repeatable): YAML or JSON, several documents or `List`s, holding
  ResourceSlices and optionally DeviceClasses, allocated ResourceClaims, Namespaces and
  DeviceTaintRules (e.g. `kubectl get resourceslices,deviceclasses,resourceclaims -A -o yaml`);
- a mock node (`--mock PROFILE`): the slices `dra-driver run --mock PROFILE` publishes,
  with the chart's DeviceClasses;
- a cluster, through a kubeconfig: the same objects, listed.

The claim is a ResourceClaim or ResourceClaimTemplate by name (in the files, or in the
cluster), or every claim of `-f FILE`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from driver.kube import releases
from driver.publish import mocknode
from driver.demo.claims import yaml_problem
from driver.scheduling import claimspec

MOCK_NODE = mocknode.MOCK_NODE
CLAIM_KINDS = ("ResourceClaim", "ResourceClaimTemplate")


class SourceError(Exception):
    """Input that cannot be used; the message names the file, object or server."""


@dataclass(frozen=True)
class Claim:
    kind: str  # ResourceClaim | ResourceClaimTemplate
    namespace: str
    name: str
    spec: dict  # the claim spec (a template's spec.spec)
    uid: str | None = None
    allocated_on: str | None = None  # the node of its current allocation, if any
    origin: str = ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def read_objects(path: Path, option: str) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as err:
        raise SourceError(f"{option} {path}: cannot read it: {err.strerror or err}") from None
    try:
        docs = [json.loads(text)] if text.lstrip().startswith("{") else list(yaml.safe_load_all(text))
    except json.JSONDecodeError as err:
        raise SourceError(f"{option} {path}: not JSON: {err.msg} (line {err.lineno})") from None
    except yaml.YAMLError as err:
        raise SourceError(f"{option} {path}: not YAML: {yaml_problem(err)}") from None
    objects = []
    for index, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
            raise SourceError(f"{option} {path}: document {index + 1} is not a Kubernetes object (no kind)")
        items = doc.get("items") if doc["kind"].endswith("List") else [doc]
        for item in items or []:
            if not isinstance(item, dict) or not isinstance(item.get("metadata"), dict):
                raise SourceError(f"{option} {path}: document {index + 1}: an item without metadata")
            if item.get("kind") == "DeviceClass":
                # The server compiles a class's selectors when it is written: reported once,
                # here, not as an error on each device the class is tried on.
                try:
                    claimspec.check_class(item)
                except claimspec.ClaimSpecError as err:
                    raise SourceError(f"{option} {path}: {err}") from None
            objects.append(item)
    return objects


def mock_objects(profile: str, driver: str, gpu_sharing: str, mig_mode: str) -> list[dict]:
    try:
        return mocknode.mock_objects(profile, driver, gpu_sharing, mig_mode)
    except mocknode.MockNodeError as err:
        raise SourceError(str(err)) from None


inventory_objects = mocknode.inventory_objects


def claims_in(objects: list[dict], origin: str, default_namespace: str) -> list[Claim]:
    found = []
    for obj in objects:
        if obj.get("kind") not in CLAIM_KINDS:
            continue
        meta = obj.get("metadata") or {}
        allocation = (obj.get("status") or {}).get("allocation") or {}
        # Judged as the API server takes it (v1beta1 and v1beta2 converted to v1): a claim
        # it refuses is that refusal, never "fits". An allocated claim only holds devices
        # here, whatever its spec says (our API emulator's are bare).
        try:
            spec = claimspec.convert(obj).spec
        except claimspec.ClaimSpecError as err:
            if not allocation:
                raise SourceError(f"{origin}: {err}") from None
            spec = obj.get("spec") or {}
            if obj["kind"] == "ResourceClaimTemplate":
                spec = spec.get("spec") or {}
        node = _allocated_node(allocation)
        found.append(Claim(obj["kind"], meta.get("namespace") or default_namespace,
                           meta.get("name", "?"), spec, meta.get("uid"), node, origin))
    return found


def _allocated_node(allocation: dict) -> str | None:
    terms = ((allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or [])
    for term in terms:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return field["values"][0]
    return "a node" if allocation else None


def pick(claims: list[Claim], name: str | None, namespace: str | None, where: str,
         hint: str = "") -> list[Claim]:
    if name is None:
        if not claims:
            raise SourceError(f"{where}: no ResourceClaim or ResourceClaimTemplate in it")
        return claims
    chosen = [c for c in claims if c.name == name and namespace in (None, c.namespace)]
    # A ResourceClaim wins over a template of the same name, as `explain NAME` documents.
    chosen.sort(key=lambda c: c.kind != "ResourceClaim")
    if not chosen:
        known = ", ".join(sorted({c.name for c in claims})) or "none"
        raise SourceError(f"{where}: no ResourceClaim or ResourceClaimTemplate {name!r}"
                          f"{f' in namespace {namespace}' if namespace else ''} (claims there: {known})"
                          f"{hint}")
    return chosen[:1]


# -- a cluster ----------------------------------------------------------------------------------
def resource_version(kube) -> str:
    """The resource.k8s.io version the cluster serves; an unreachable server, or one that
    serves no resource.k8s.io we speak, is a SourceError naming the server (exit 2: not a verdict)."""
    from driver.kube.client import ApiError, NoResourceApi, NotFound

    client = getattr(kube, "client", None)
    server = getattr(getattr(client, "config", None), "server", None) or "the API server"
    try:
        return kube.resource_version()
    except (NotFound, NoResourceApi) as err:
        release = server_release(kube)
        at = f"{server} (Kubernetes {releases.text(release)})" if release else server
        what = ("does not serve resource.k8s.io" if isinstance(err, NotFound)
                else "serves no resource.k8s.io version this driver knows")
        raise SourceError(f"{at} {what}: {releases.dra_requirement()}") from None
    except ApiError as err:
        if err.status == 0:
            raise SourceError(f"cannot reach {server}: {err}") from None
        raise SourceError(f"{server}: cannot read its resource.k8s.io versions: {err}") from None


def server_release(kube) -> releases.Release | None:
    """The cluster's Kubernetes release; None where /version cannot be read."""
    from driver.kube.client import ApiError

    try:
        return kube.server_version()
    except ApiError:
        return None


def cluster_objects(kube, namespace: str, nodes: bool = False) -> tuple[list[dict], list[str]]:
    """ResourceSlices, DeviceClasses, ResourceClaims (all namespaces where allowed), the
    claim's Namespace and DeviceTaintRules, and the Nodes with `nodes` or where a slice has
    a nodeSelector (their labels place its devices, their allocatable shows what device
    plugins serve); and notes on what could not be read."""
    from driver.kube.client import ApiError, NotFound

    notes: list[str] = []
    base = f"/apis/resource.k8s.io/{resource_version(kube)}"

    def listed(path: str, kind: str) -> list[dict]:
        items = (kube.request("GET", path) or {}).get("items") or []
        for item in items:
            item.setdefault("kind", kind)
        return items

    try:
        objects = listed(f"{base}/resourceslices", "ResourceSlice")
        objects += listed(f"{base}/deviceclasses", "DeviceClass")
    except ApiError as err:
        raise SourceError(f"cannot list ResourceSlices and DeviceClasses: {err}") from None
    try:
        objects += listed(f"{base}/resourceclaims", "ResourceClaim")
    except ApiError as err:
        notes.append(f"other namespaces' claims not readable ({err}); allocations there are not counted")
        objects += listed(f"{base}/namespaces/{namespace}/resourceclaims", "ResourceClaim")
    try:
        ns = kube.request("GET", f"/api/v1/namespaces/{namespace}")
        objects.append({**ns, "kind": "Namespace"})
    except ApiError as err:
        notes.append(f"namespace {namespace} not readable ({err}); admin access is not checked")
    # Node labels decide where a slice's nodeSelector puts its devices
    nodes = nodes or any(
        (o.get("spec") or {}).get("nodeSelector") or (o.get("spec") or {}).get("perDeviceNodeSelection")
        for o in objects if o.get("kind") == "ResourceSlice")
    if nodes:
        try:
            objects += listed("/api/v1/nodes", "Node")
        except ApiError as err:
            notes.append(f"Nodes not readable ({err}): their labels (for slices' nodeSelectors) "
                         "and device plugins' resources in their status.allocatable are not seen")
    for rules_version in ("v1beta2", "v1alpha3"):
        try:
            objects += listed(f"/apis/resource.k8s.io/{rules_version}/devicetaintrules", "DeviceTaintRule")
            break
        except NotFound:
            continue
        except ApiError as err:
            notes.append(f"DeviceTaintRules not readable ({err})")
            break
    return objects, notes


def cluster_claim(kube, name: str, namespace: str) -> Claim:
    from driver.kube.client import ApiError, NotFound

    version = resource_version(kube)
    for kind, resource in (("ResourceClaim", "resourceclaims"), ("ResourceClaimTemplate", "resourceclaimtemplates")):
        try:
            obj = kube.request("GET", f"/apis/resource.k8s.io/{version}/namespaces/{namespace}/{resource}/{name}")
        except NotFound:
            continue
        except ApiError as err:
            raise SourceError(f"cannot read {kind} {namespace}/{name}: {err}") from None
        obj["kind"] = kind
        return claims_in([obj], "the cluster", namespace)[0]
    raise SourceError(f"no ResourceClaim or ResourceClaimTemplate {name!r} in namespace {namespace}")
