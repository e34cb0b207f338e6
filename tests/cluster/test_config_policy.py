"""The chart's opaque-config ValidatingAdmissionPolicy, evaluated by the real API server
(dry-run creates: admission runs, nothing is stored), against the verdicts and messages
that tests/test_config_policy.py computes with its own CEL evaluation of the same policy:
every good and bad config of that table, as a ResourceClaim, a ResourceClaimTemplate and a
DeviceClass. And every example in examples/ passes the real policy as `kubectl apply
--dry-run=server` applies it."""

from __future__ import annotations

import copy
import json
import time

import pytest

from tests.cluster.driverhost import install
from tests.cluster.workloads import example_param
from tests.conftest import REPO
from tests.test_config_policy import CASES, KINDS, admitted, wrap

NAMESPACE = "config-policy"
# Cases where the real API server answers with another message than the emulated policy
# (same verdict), and the message it gives instead: listed in docs/testing.md.
KNOWN_MESSAGES = {
    # the server's own validation of opaque parameters refuses a non-object before
    # admission runs, so the policy's message never shows
    "not an object": "must be a valid JSON object",
}


@pytest.fixture(scope="module")
def policy(cluster):
    objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}, "mock": {"enabled": True}})
    (found,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"
                and o["metadata"]["name"].endswith("-opaque-config")]
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    # the policy is in force once the API server's informers have it: wait for a known bad one
    deadline = time.monotonic() + 20
    while real_verdict(cluster, wrap("ResourceClaim", {"apiVersion": "x"}))[0] and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def real_verdict(cluster, obj: dict) -> tuple[bool, str]:
    obj = copy.deepcopy(obj)
    kind = obj["kind"]
    if kind == "DeviceClass":
        path = "/apis/resource.k8s.io/v1/deviceclasses"
    else:
        obj["metadata"]["namespace"] = NAMESPACE
        path = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/{kind.lower()}s"
    code, body = cluster.api("POST", path + "?dryRun=All", obj)
    return code in (200, 201), body.get("message", "")


def test_real_api_server_agrees_with_the_emulated_policy(cluster, policy):
    disagreements = []
    for name, parameters, good in CASES:
        for kind in KINDS:
            obj = wrap(kind, parameters)
            real, message = real_verdict(cluster, obj)
            emulated, why = admitted(policy, obj)
            if real != emulated or real != good:
                disagreements.append(f"{name} as {kind}: table says {'good' if good else 'bad'}, "
                                     f"emulated {'admitted' if emulated else 'denied: ' + why}, "
                                     f"real API server {'admitted' if real else 'denied: ' + message}")
            elif name in KNOWN_MESSAGES:
                if KNOWN_MESSAGES[name] not in message:
                    disagreements.append(f"{name} as {kind}: expected the server's {KNOWN_MESSAGES[name]!r}, "
                                         f"got {message!r}")
            elif not real and why.startswith("opaque config") and why not in message:
                disagreements.append(f"{name} as {kind}: emulated message {why!r} not in the real one {message!r}")
    assert not disagreements, "\n".join(disagreements)


def test_bad_config_is_refused_at_kubectl_apply_with_our_message(cluster, policy):
    claim = wrap("ResourceClaim", {"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "envs": {}})
    claim["metadata"]["namespace"] = NAMESPACE
    p = cluster.kubectl("apply", "-f", "-", input=json.dumps(claim), check=False)
    assert p.returncode != 0
    assert "opaque config for accel.dra.io: unknown field" in p.stderr, p.stderr


@pytest.mark.parametrize("example", [example_param(p.parent.name)
                                     for p in sorted((REPO / "examples").glob("*/claim.yaml"))])
def test_every_example_passes_the_real_policy(cluster, policy, example):
    p = cluster.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f",
                        str(REPO / "examples" / example / "claim.yaml"), check=False)
    assert p.returncode == 0, p.stderr
