"""hack/local-cluster/served.py: the cluster tier's v1 objects in the version an older
release serves (1.32: v1beta1, 1.33: v1beta2), and read back as v1. Checked against the
driver's own reading of v1beta1 claims (driver/scheduling/claimspec.py, which follows the
API server's conversion), so the two are not the same code agreeing with itself."""

from __future__ import annotations

import importlib.util

from driver.scheduling import claimspec
from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("served_under_test", REPO / "hack" / "local-cluster" / "served.py")
served = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(served)

CLAIM = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
         "spec": {"devices": {"requests": [
             {"name": "gpu", "exactly": {"deviceClassName": "gpu.accel.dra.io", "count": 2,
                                         "allocationMode": "ExactCount",
                                         "selectors": [{"cel": {"expression": "true"}}]}},
             {"name": "any", "firstAvailable": [{"name": "a", "deviceClassName": "mig.accel.dra.io"}]}],
             "constraints": [{"requests": ["gpu"], "matchAttribute": "accel.dra.io/pcieRoot"}]}}}
SLICE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
         "spec": {"driver": "accel.dra.io", "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                  "devices": [{"name": "gpu-0", "attributes": {"model": {"string": "H100"}},
                               "capacity": {"memory": {"value": "80Gi"}}}]}}


def test_a_v1_claim_in_v1beta1_is_what_the_api_server_reads_as_the_same_claim():
    old = served.down(CLAIM, "v1beta1")
    assert old["apiVersion"] == "resource.k8s.io/v1beta1"
    assert old["spec"]["devices"]["requests"][0] == {
        "name": "gpu", "deviceClassName": "gpu.accel.dra.io", "count": 2, "allocationMode": "ExactCount",
        "selectors": [{"cel": {"expression": "true"}}]}
    # the driver's reading of a v1beta1 claim (the API server's conversion) gives the v1 spec back
    assert claimspec.convert(old).spec["devices"]["requests"][0]["exactly"] == \
        claimspec.convert(CLAIM).spec["devices"]["requests"][0]["exactly"]
    assert served.up(old) == CLAIM
    assert CLAIM["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2, "the input is left as it was"


def test_a_template_a_slice_and_a_list_go_down_and_come_back():
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
                "spec": {"spec": CLAIM["spec"]}}
    assert "exactly" not in served.down(template, "v1beta1")["spec"]["spec"]["devices"]["requests"][0]
    assert served.up(served.down(template, "v1beta1")) == template
    old_slice = served.down(SLICE, "v1beta1")
    assert old_slice["spec"]["devices"] == [{"name": "gpu-0", "basic": {
        "attributes": {"model": {"string": "H100"}}, "capacity": {"memory": {"value": "80Gi"}}}}]
    assert served.up(old_slice) == SLICE
    # the API server's lists carry kind and apiVersion on the list only
    listed = {"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceSliceList", "metadata": {},
              "items": [{k: v for k, v in old_slice.items() if k not in ("apiVersion", "kind")}]}
    assert served.up(listed)["items"] == [SLICE]


def test_v1beta2_is_v1_by_another_name_and_v1_is_left_alone():
    assert served.down(CLAIM, "v1beta2") == {**CLAIM, "apiVersion": "resource.k8s.io/v1beta2"}
    assert served.up(served.down(CLAIM, "v1beta2")) == CLAIM
    assert served.down(CLAIM, "v1") is CLAIM
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
    assert served.down(pod, "v1beta1") is pod and served.up(pod) is pod
    assert served.path("/apis/resource.k8s.io/v1/resourceslices?x=1", "v1beta1") == \
        "/apis/resource.k8s.io/v1beta1/resourceslices?x=1"
    assert served.path("/apis/resource.k8s.io/v1", "v1beta2") == "/apis/resource.k8s.io/v1beta2"
    assert served.path("/apis/resource.k8s.io/v1beta1/x", "v1beta2") == "/apis/resource.k8s.io/v1beta1/x"
    assert served.path("/api/v1/pods", "v1beta1") == "/api/v1/pods"
