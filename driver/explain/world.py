"""What the scheduler sees, as plain data: every driver's published devices per node, the
DeviceClasses, what other claims already hold, namespace labels and DeviceTaintRules.

Built from API objects as they come from the API server or from files, in any served
version of resource.k8s.io (v1beta1's `basic` device wrapper included). Like the
scheduler it uses only the newest generation of each pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Any, Iterable

from driver.kube import quantity as quantities
from driver.scheduling import cel


class WorldError(ValueError):
    """An object that cannot be what it claims to be; the message names it."""


@dataclass(frozen=True)
class PoolDevice:
    driver: str
    pool: str
    name: str
    node: str | None  # None: every node (allNodes / a node selector)
    slice: str
    attributes: dict[str, dict]  # as published: name -> {"string": ...} etc.
    capacity: dict[str, dict]  # name -> {"value": ..., "requestPolicy": ...}
    taints: tuple[dict, ...] = ()
    multiple: bool = False  # allowMultipleAllocations
    consumes: dict[str, dict[str, Decimal]] = field(default_factory=dict)  # counter set ->

    @property
    def key(self) -> str:
        return f"{self.driver}/{self.pool}/{self.name}"

    def attribute(self, qualified: str) -> Any:
        """The value of `domain/name` (or a bare name: the driver's domain), None if absent."""
        domain, _, name = qualified.rpartition("/")
        for key in ((name,) if domain in ("", self.driver) else ()) + (qualified,):
            if key in self.attributes:
                return plain(self.attributes[key])
        return None

    def lookup(self, kind: str, domain: str, name: str) -> Any:
        """What `device.<kind>["domain"].name` reads; None when the device has no such key."""
        table = self.attributes if kind == "attributes" else self.capacity
        for key in ((name,) if domain == self.driver else ()) + (f"{domain}/{name}",):
            if key in table:
                return plain(table[key]) if kind == "attributes" else QuantityText(table[key]["value"])
        return None

    def names(self, kind: str, domain: str) -> set[str]:
        table = self.attributes if kind == "attributes" else self.capacity
        found = set()
        for key in table:
            d, _, n = key.rpartition("/")
            if (d or self.driver) == domain:
                found.add(n)
        return found

    def unsupported_attribute(self) -> str | None:
        """The name of an attribute with no value of a type Kubernetes knows (the API server
        does not store one, the allocator refuses one), if any."""
        for name, value in self.attributes.items():
            if not (isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ATTRIBUTE_TYPES):
                return name.rsplit("/", 1)[-1]
        return None

    def activation(self) -> dict:
        attributes: dict[str, dict[str, Any]] = {}
        for key, value in cel.by_domain(self.attributes, self.driver).items():
            attributes[key] = {n: _cel_input(v) for n, v in value.items()}
        capacity = {d: {n: c["value"] for n, c in caps.items()}
                    for d, caps in cel.by_domain(self.capacity, self.driver).items()}
        return cel.activation(self.driver, attributes, capacity, self.multiple)



class RememberedDevice(PoolDevice):
    """A device judged many times over (capacity's sizes, blocking's candidate sets): what
    CEL sees of it, and whether an attribute has no known type, are worked out once. The
    device is frozen, so neither can change between judgements; building the activation
    was most of an engine run."""

    @classmethod
    def of(cls, device: PoolDevice) -> "RememberedDevice":
        return cls(**{f.name: getattr(device, f.name) for f in fields(device)})

    def activation(self) -> dict:
        cached = self.__dict__.get("_activation")
        if cached is None:
            cached = super().activation()
            object.__setattr__(self, "_activation", cached)
        return cached

    def unsupported_attribute(self) -> str | None:
        if "_unsupported" not in self.__dict__:
            object.__setattr__(self, "_unsupported", super().unsupported_attribute())
        return self.__dict__["_unsupported"]

def plain(value: dict) -> Any:
    """A published attribute value ({"int": 3}) as Python; versions as VersionText; a list
    attribute ({"ints": [1, 2]}, KEP-5491) as a tuple."""
    if not isinstance(value, dict) or len(value) != 1:
        return None
    (kind, v), = value.items()
    if kind == "versions" and isinstance(v, list):
        return tuple(VersionText(str(x)) for x in v)
    if isinstance(v, list):
        return tuple(v)
    return VersionText(str(v)) if kind == "version" else v


ATTRIBUTE_TYPES = {"int", "bool", "string", "version", "ints", "bools", "strings", "versions"}


class VersionText(str):
    """A `version` attribute (a string that CEL sees as a semver)."""


class QuantityText(str):
    """A capacity value (a string that CEL sees as a quantity)."""


def _cel_input(value: dict) -> Any:
    v = plain(value)
    if isinstance(v, tuple):
        return [_cel_input({"version" if isinstance(x, VersionText) else "value": x}) for x in v]
    if isinstance(v, VersionText):
        try:
            return cel.SemVer(v)
        except ValueError:
            return str(v)  # not semver: the API server would not have stored it
    return v


def display(value: Any) -> str:
    if value is None:
        return "<absent>"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(display(v) for v in value) + "]"
    if isinstance(value, str) and not isinstance(value, (VersionText, QuantityText)):
        return f'"{value}"'
    return str(value)


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...]
    extended_resource_name: str | None = None  # spec.extendedResourceName (1.34+)
    created: str = ""  # metadata.creationTimestamp: the newer of two classes naming one resource wins


@dataclass(frozen=True)
class Holder:
    """What one allocation result holds: the claim, and capacity when it is a share."""

    claim: str  # namespace/name
    uid: str
    consumed: dict[str, str] | None = None  # None: not a share (it holds the device whole)


@dataclass
class World:
    devices: list[PoolDevice] = field(default_factory=list)
    counter_sets: dict[tuple[str, str, str], dict[str, Decimal]] = field(default_factory=dict)
    classes: dict[str, DeviceClass] = field(default_factory=dict)
    claims: list[dict] = field(default_factory=list)
    namespaces: dict[str, dict[str, str]] | None = None  # None: labels unknown (offline)
    # node -> its status.allocatable, for the nodes whose Node object was given; a device
    # plugin's resources show there (extended resources it serves are not DRA's there)
    allocatable: dict[str, dict[str, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # (driver, pool) -> why the scheduler allocates nothing from it: "incomplete" (not all
    # slices of its newest generation seen) or "invalid: ..." (a device twice, an unknown
    # counter set), with the nodes it has slices on (None: every node).
    unusable_pools: dict[tuple[str, str], tuple[str, frozenset | None]] = field(default_factory=dict)
    # node -> its labels, for the nodes whose Node object was given (a slice's nodeSelector
    # is evaluated on them; on a node without, it is taken to match, with a note)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    # node -> its spec.taints, for the nodes whose Node object was given (a pod's node filter)
    node_taints: dict[str, list[dict]] = field(default_factory=dict)
    release: tuple[int, int] | None = None  # the cluster's Kubernetes release, when read from one
    # a node's view only: devices of its pools' slices that do not target it (their
    # allocations use the pool's shared counters too)
    elsewhere: list[PoolDevice] = field(default_factory=list)
    slice_objects: list[dict] = field(default_factory=list, repr=False)
    rule_objects: list[dict] = field(default_factory=list, repr=False)
    _views: dict[str, "World"] = field(default_factory=dict, repr=False, compare=False)
    _index: "SliceIndex | None" = field(default=None, repr=False, compare=False)

    def nodes(self) -> list[str]:
        named = {d.node for d in self.devices if d.node is not None}
        if any(d.node is None for d in self.devices):
            named |= set(self.labels)  # nodes known by their Node objects may match selectors
        return sorted(named)

    def on_node(self, node: str) -> list[PoolDevice]:
        return [d for d in self.devices if d.node in (node, None)]

    def view(self, node: str) -> "World":
        """The world as the scheduler gathers it for one node (upstream's GatherPools): the
        slices that target the node (its name, all nodes, a nodeSelector that matches its
        labels, a device of a per-device slice that does), per pool the newest generation
        among those; a pool the node sees only part of is complete if the other nodes' slices
        of that generation make up the count, obsolete (left out) if some slice is newer, and
        incomplete otherwise. A pool moving to a new generation can thus serve one node from
        its old slices while another has the new ones."""
        if node not in self._views:
            view = World(classes=self.classes, claims=self.claims, namespaces=self.namespaces,
                         allocatable=self.allocatable, labels=self.labels, node_taints=self.node_taints,
                         slice_objects=self.slice_objects, rule_objects=self.rule_objects,
                         release=self.release)
            if self._index is None:
                self._index = SliceIndex.of(self.slice_objects)
            _add_slices(view, self.slice_objects, node, self._index)
            _apply_taint_rules(view, self.rule_objects)
            self._views[node] = view
        return self._views[node]

    def holders(self, skip_uid: str | None = None) -> dict[str, list[Holder]]:
        """device key -> the allocation results of other claims on it (admin access aside:
        such results ignore, and do not block, ordinary claims)."""
        held: dict[str, list[Holder]] = {}
        for claim in self.claims:
            meta = claim.get("metadata") or {}
            if skip_uid is not None and meta.get("uid") == skip_uid:
                continue
            results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
                       .get("results") or [])
            ref = f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}"
            for result in results:
                if result.get("adminAccess"):
                    continue
                key = f"{result.get('driver')}/{result.get('pool')}/{result.get('device')}"
                consumed = result.get("consumedCapacity")
                if consumed is None and result.get("shareID"):
                    # A share of a device without capacity: the scheduler keeps it by share ID
                    # and it does not hold the device whole.
                    consumed = {}
                held.setdefault(key, []).append(Holder(ref, meta.get("uid", ""), consumed))
        return held


def build(objects: Iterable[dict]) -> World:
    """A World from API objects (ResourceSlice, DeviceClass, ResourceClaim, Namespace,
    DeviceTaintRule, Node; anything else is ignored)."""
    world = World()
    slices: list[dict] = []
    rules: list[dict] = []
    for obj in objects:
        kind = obj.get("kind")
        name = (obj.get("metadata") or {}).get("name", "?")
        if kind == "ResourceSlice":
            slices.append(obj)
        elif kind == "DeviceClass":
            selectors = tuple(s["cel"]["expression"] for s in (obj.get("spec") or {}).get("selectors") or []
                              if isinstance(s, dict) and "cel" in s)
            spec = obj.get("spec") or {}
            world.classes[name] = DeviceClass(name, selectors, spec.get("extendedResourceName") or None,
                                              str((obj.get("metadata") or {}).get("creationTimestamp") or ""))
        elif kind == "ResourceClaim":
            world.claims.append(obj)
        elif kind == "Namespace":
            world.namespaces = world.namespaces or {}
            world.namespaces[name] = dict((obj.get("metadata") or {}).get("labels") or {})
        elif kind == "DeviceTaintRule":
            rules.append(obj)
        elif kind == "Node":
            world.allocatable[name] = {k: str(v) for k, v in
                                       ((obj.get("status") or {}).get("allocatable") or {}).items()}
            world.labels[name] = dict((obj.get("metadata") or {}).get("labels") or {})
            world.node_taints[name] = [t for t in (obj.get("spec") or {}).get("taints") or [] if isinstance(t, dict)]
    world.slice_objects, world.rule_objects = slices, rules
    _add_slices(world, slices)
    _apply_taint_rules(world, rules)
    return world


def _pool_key(obj: dict) -> tuple[str, str]:
    spec = obj.get("spec") or {}
    return spec.get("driver", ""), (spec.get("pool") or {}).get("name", "")


def _generation(obj: dict) -> int:
    return int(((obj.get("spec") or {}).get("pool") or {}).get("generation", 0))


def _slice_count(obj: dict) -> int:
    return int(((obj.get("spec") or {}).get("pool") or {}).get("resourceSliceCount", 1))


def node_matches(node: str, labels: dict[str, str] | None, name: str | None, all_nodes: bool,
                 selector: dict | None) -> bool | None:
    """Whether a slice's (or a device's) node fields select the node; None when nothing
    selects (no field set). A nodeSelector on a node whose labels are unknown matches."""
    if name:
        return name == node
    if all_nodes:
        return True
    if selector is not None:
        return True if labels is None else selector_matches(selector, node, labels)
    return None


def selector_matches(selector: dict, node: str, labels: dict[str, str]) -> bool:
    """A core/v1 NodeSelector: its terms ORed, a term's requirements ANDed; a term with no
    requirement matches nothing."""
    for term in selector.get("nodeSelectorTerms") or []:
        expressions = term.get("matchExpressions") or []
        fields = term.get("matchFields") or []
        if not expressions and not fields:
            continue
        if all(_requirement(r, labels) for r in expressions) and \
                all(_requirement(r, {"metadata.name": node}) for r in fields):
            return True
    return False


def _requirement(req: dict, values: dict[str, str]) -> bool:
    key, op, wanted = req.get("key", ""), req.get("operator", ""), req.get("values") or []
    have = values.get(key)
    if op == "In":
        return have is not None and have in wanted
    if op == "NotIn":
        return have is None or have not in wanted
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt"):
        try:
            left, right = int(have or ""), int(wanted[0])
        except (ValueError, IndexError):
            return False
        return left > right if op == "Gt" else left < right
    return False


@dataclass
class SliceIndex:
    """The slices by the node they name and by pool, built once for all nodes' views: as
    upstream's allocator keeps them, so that gathering one node's slices does not read every
    node's (at 1,000 nodes that was most of explain's time)."""

    by_node: dict[str, list[dict]]
    untargeted: list[dict]  # allNodes, a nodeSelector, per-device selection
    by_pool: dict[tuple[str, str], list[dict]]

    @classmethod
    def of(cls, slices: list[dict]) -> "SliceIndex":
        index = cls({}, [], {})
        for obj in slices:
            name = (obj.get("spec") or {}).get("nodeName")
            (index.by_node.setdefault(name, []) if name else index.untargeted).append(obj)
            index.by_pool.setdefault(_pool_key(obj), []).append(obj)
        return index

    def candidates(self, node: str) -> list[dict]:
        """The slices that can target `node`, in the order the slice list had them."""
        return self.by_node.get(node, []) + self.untargeted


def _gather(world: World, slices: list[dict], node: str,
            index: SliceIndex | None = None) -> tuple[list[dict], list[dict], set]:
    """(the slices the scheduler uses on the node, the other slices of those pools' chosen
    generation, the pools it finds incomplete)."""
    index = index or SliceIndex.of(slices)
    labels = world.labels.get(node)
    relevant: dict[tuple[str, str], list[dict]] = {}
    for obj in index.candidates(node):
        spec = obj.get("spec") or {}
        match = node_matches(node, labels, spec.get("nodeName"), bool(spec.get("allNodes")),
                             spec.get("nodeSelector"))
        if match is None and spec.get("perDeviceNodeSelection"):
            match = any(node_matches(node, labels, d.get("nodeName"), bool(d.get("allNodes")),
                                     d.get("nodeSelector")) for d in spec.get("devices") or [])
        if not match:
            continue
        key = _pool_key(obj)
        held = relevant.get(key)
        if held is None or _generation(obj) > _generation(held[0]):
            relevant[key] = [obj]
        elif _generation(obj) == _generation(held[0]):
            held.append(obj)
    chosen: list[dict] = []
    others: list[dict] = []
    incomplete: set = set()
    for key, found in relevant.items():
        generation, expected = _generation(found[0]), _slice_count(found[0])
        if len(found) == expected:
            chosen += found
            continue
        pool = index.by_pool.get(key, [])
        if any(_generation(o) > generation for o in pool):
            continue  # obsolete on this node: a newer generation is being published
        same = [o for o in pool if _generation(o) == generation]
        if len(same) != expected:
            incomplete.add(key)
            continue
        chosen += found
        others += [o for o in same if not any(o is f for f in found)]
    return chosen, others, incomplete


def _add_slices(world: World, slices: list[dict], node: str | None = None,
                index: SliceIndex | None = None) -> None:
    """The devices, counter sets and unusable pools of `slices`: for one node as the scheduler
    gathers them there (see World.view), or, without a node, for the whole cluster (each
    pool's newest generation; what explain lists nodes and notes from)."""
    others: list[dict] = []
    if node is None:
        newest: dict[tuple[str, str], int] = {}
        for obj in slices:
            newest[_pool_key(obj)] = max(newest.get(_pool_key(obj), 0), _generation(obj))
        slices = [o for o in slices if _generation(o) == newest[_pool_key(o)]]  # older: ignored
        seen: dict[tuple[str, str], int] = {}
        expected: dict[tuple[str, str], int] = {}
        for obj in slices:
            seen[_pool_key(obj)] = seen.get(_pool_key(obj), 0) + 1
            expected[_pool_key(obj)] = _slice_count(obj)
        incomplete = {key for key, count in seen.items() if count != expected[key]}
        for key in sorted(incomplete):
            count = (f"{seen[key]} of {expected[key]} slices" if seen[key] < expected[key] else
                     f"{seen[key]} slices (it announces {expected[key]})")
            world.notes.append(f"pool {key[1]} of {key[0]}: {count} of its newest generation seen (being "
                               "updated): the scheduler allocates none of its devices until it is complete")
    else:
        slices, others, incomplete = _gather(world, slices, node, index)
    for key in sorted(incomplete):
        _unusable(world, *key, "incomplete")
    pool_nodes: dict[tuple[str, str], set | None] = {}
    # The scheduler visits pools by driver and name, a pool's slices by name, a slice's
    # devices in order: the first fitting devices it meets are the ones it picks.
    def order(o: dict) -> tuple[str, str, str]:
        return _pool_key(o) + ((o.get("metadata") or {}).get("name", ""),)

    # (the slices that do not target the node come last, for their counters only)
    for targets, obj in [(True, o) for o in sorted(slices, key=order)] + [(False, o) for o in sorted(others, key=order)]:
        spec = obj.get("spec") or {}
        driver, pool_name = _pool_key(obj)
        slice_name = (obj.get("metadata") or {}).get("name", "?")
        slice_node = spec.get("nodeName")
        if targets:
            nodes = pool_nodes.setdefault((driver, pool_name), set())
            if nodes is not None:
                if slice_node is None:
                    pool_nodes[(driver, pool_name)] = None
                else:
                    nodes.add(slice_node)
        if node is None and slice_node is None and spec.get("nodeSelector") and not world.labels:
            world.notes.append(f"slice {slice_name}: its nodeSelector is not evaluated (no Node objects); "
                               "its devices are counted on every node")
        for counter_set in spec.get("sharedCounters") or []:
            if (driver, pool_name, counter_set["name"]) in world.counter_sets:
                _unusable(world, driver, pool_name, f"invalid: counter set {counter_set['name']} is defined twice")
            world.counter_sets[(driver, pool_name, counter_set["name"])] = {
                k: _value(v.get("value"), f"slice {slice_name} counter set {counter_set['name']}")
                for k, v in (counter_set.get("counters") or {}).items()}
        for raw in spec.get("devices") or []:
            body = raw.get("basic", raw)  # v1beta1 wraps the fields in `basic`
            consumes = {use["counterSet"]: {k: _value(v.get("value"), f"device {raw.get('name')}")
                                            for k, v in (use.get("counters") or {}).items()}
                        for use in body.get("consumesCounters") or []}
            device_node = body.get("nodeName", slice_node)
            here = targets
            if node is not None and targets:
                if spec.get("perDeviceNodeSelection"):
                    here = bool(node_matches(node, world.labels.get(node), body.get("nodeName"),
                                             bool(body.get("allNodes")), body.get("nodeSelector")))
                device_node = node  # gathered for this node
            device = PoolDevice(
                driver=driver, pool=pool_name, name=raw.get("name", "?"),
                node=device_node, slice=slice_name,
                attributes=dict(body.get("attributes") or {}),
                capacity={k: v for k, v in (body.get("capacity") or {}).items() if isinstance(v, dict)},
                taints=tuple(body.get("taints") or ()),
                multiple=bool(body.get("allowMultipleAllocations")),
                consumes=consumes)
            (world.devices if here else world.elsewhere).append(device)
    names: dict[tuple[str, str], set[str]] = {}
    for device in world.devices:
        pool = (device.driver, device.pool)
        if device.name in names.setdefault(pool, set()):
            _unusable(world, *pool, f"invalid: device {device.name} is listed twice")
        names[pool].add(device.name)
    for device in world.devices + world.elsewhere:
        pool = (device.driver, device.pool)
        for counter_set, counters in device.consumes.items():
            total = world.counter_sets.get((device.driver, device.pool, counter_set))
            if total is None:
                _unusable(world, *pool, f"invalid: device {device.name} consumes counter set "
                                        f"{counter_set}, which the pool does not define")
            elif set(counters) - set(total):
                _unusable(world, *pool, f"invalid: device {device.name} consumes counter "
                                        f"{sorted(set(counters) - set(total))[0]} of set {counter_set}, "
                                        "which the set does not define")
    for key, (why, _) in list(world.unusable_pools.items()):
        nodes = pool_nodes.get(key)
        world.unusable_pools[key] = (why, None if nodes is None else frozenset(nodes))
        if why != "incomplete":
            world.notes.append(f"pool {key[1]} of {key[0]} is {why}: the scheduler allocates none of its devices")
    world.devices = [d for d in world.devices if (d.driver, d.pool) not in world.unusable_pools]


def _unusable(world: World, driver: str, pool: str, why: str) -> None:
    world.unusable_pools.setdefault((driver, pool), (why, None))


def _value(text: Any, where: str) -> Decimal:
    try:
        return quantities.value(str(text))
    except quantities.QuantityError as err:
        raise WorldError(f"{where}: {err}") from None


def _apply_taint_rules(world: World, rules: list[dict]) -> None:
    for rule in rules:
        spec = rule.get("spec") or {}
        selector = spec.get("deviceSelector") or {}
        taint = spec.get("taint")
        if not taint:
            continue
        for index, device in enumerate(world.devices):
            if all(selector.get(k) in (None, v) for k, v in
                   (("driver", device.driver), ("pool", device.pool), ("device", device.name))):
                world.devices[index] = PoolDevice(**{**device.__dict__, "taints": device.taints + (taint,)})
