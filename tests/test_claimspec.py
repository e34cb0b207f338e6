"""Claims judged as the API server takes them (issue 40, items 1 and 2): decoded strictly
for their apiVersion, v1beta1 converted to v1 as Kubernetes converts it, the server's
field errors for what it refuses, and a selector that does not compile reported once, as
the server's compile error with its caret, before any device is looked at."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from driver.demo.claims import ClaimFileError, from_file
from driver.scheduling import claimspec
from tests.conftest import REPO


def claim(version: str, requests: list, kind: str = "ResourceClaim") -> dict:
    spec = {"devices": {"requests": requests}}
    if kind == "ResourceClaimTemplate":
        spec = {"spec": spec}
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": kind, "metadata": {"name": "c"}, "spec": spec}


OLD_STYLE = [{"name": "gpu", "deviceClassName": "gpu.accel.dra.io", "count": 2}]


def test_v1beta1_requests_become_exactly_with_the_server_s_defaults():
    got = claimspec.convert(claim("v1beta1", [{"name": "gpu", "deviceClassName": "gpu.accel.dra.io"}]))
    assert got.spec["devices"]["requests"] == [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.accel.dra.io", "allocationMode": "ExactCount",
                                    "count": 1}}]


def test_v1beta1_prioritized_lists_stay_and_get_their_defaults():
    got = claimspec.convert(claim("v1beta1", [{"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": "gpu.accel.dra.io"},
        {"name": "all", "deviceClassName": "gpu.accel.dra.io", "allocationMode": "All"}]}]))
    (request,) = got.spec["devices"]["requests"]
    assert "exactly" not in request
    assert request["firstAvailable"][0]["count"] == 1 and "count" not in request["firstAvailable"][1]


@pytest.mark.parametrize("version", ["v1", "v1beta2"])
def test_v1beta1_layout_in_v1_is_refused_as_strict_decoding_does(version):
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.convert(claim(version, OLD_STYLE))
    message = str(raised.value)
    assert message.startswith(f'ResourceClaim in version "{version}" cannot be handled as a ResourceClaim: '
                              'strict decoding error: unknown field "spec.devices.requests[0].deviceClassName", '
                              'unknown field "spec.devices.requests[0].count"')
    assert "under `exactly:`" in message


def test_a_template_s_paths_are_the_template_s():
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.convert(claim("v1", [{"name": "gpu"}], kind="ResourceClaimTemplate"))
    assert str(raised.value) == (
        'ResourceClaimTemplate.resource.k8s.io "c" is invalid: spec.spec.devices.requests[0]: Required value: '
        "exactly one of `exactly` or `firstAvailable` is required")


@pytest.mark.parametrize("request_, error", [
    ({"name": "gpu", "exactly": {"deviceClassName": "g"}, "firstAvailable": [{"name": "a", "deviceClassName": "g"}]},
     "spec.devices.requests[0]: Invalid value: null: exactly one of `exactly` or `firstAvailable` is required, "
     "but multiple fields are set"),
    ({"name": "gpu", "exactly": {}}, "spec.devices.requests[0].exactly.deviceClassName: Required value"),
    ({"name": "GPU", "exactly": {"deviceClassName": "g"}}, 'spec.devices.requests[0].name: Invalid value: "GPU": '
                                                           "a lowercase RFC 1123 label must consist of"),
    ({"name": "gpu", "exactly": {"deviceClassName": "g", "count": -1}},
     "spec.devices.requests[0].exactly.count: Invalid value: -1: must be greater than zero"),
    ({"name": "gpu", "exactly": {"deviceClassName": "g", "allocationMode": "All", "count": 2}},
     "spec.devices.requests[0].exactly.count: Invalid value: 2: must not be specified when allocationMode is 'All'"),
    ({"name": "gpu", "exactly": {"deviceClassName": "g", "allocationMode": "Some"}},
     'spec.devices.requests[0].exactly.allocationMode: Unsupported value: "Some": supported values: "All", '
     '"ExactCount"'),
])
def test_what_the_server_refuses_gets_its_field_error(request_, error):
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.convert(claim("v1", [request_]))
    assert str(raised.value).startswith('ResourceClaim.resource.k8s.io "c" is invalid: ' + error), str(raised.value)


def test_two_requests_of_one_name_are_a_duplicate():
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.convert(claim("v1", [{"name": "gpu", "exactly": {"deviceClassName": "g"}}] * 2))
    assert 'spec.devices.requests[1].name: Duplicate value: "gpu"' in str(raised.value)


def test_a_version_the_server_does_not_serve_for_claims_is_named():
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.convert({**claim("v1", OLD_STYLE), "apiVersion": "resource.k8s.io/v1alpha3"})
    assert str(raised.value).startswith('no matches for kind "ResourceClaim" in version "resource.k8s.io/v1alpha3"')


def test_a_selector_that_does_not_compile_is_the_server_s_compile_error_with_its_caret():
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.convert(claim("v1", [{"name": "gpu", "exactly": {
            "deviceClassName": "g", "selectors": [{"cel": {"expression": 'device.driver == "a" &&& true'}}]}}]))
    assert str(raised.value) == (
        'ResourceClaim.resource.k8s.io "c" is invalid: spec.devices.requests[0].exactly.selectors[0].cel.expression: '
        'Invalid value: "device.driver == \\"a\\" &&& true": compilation failed: ERROR: <input>:1:25: '
        "Syntax error: unexpected input\n"
        ' | device.driver == "a" &&& true\n'
        " | ........................^")


def test_a_device_class_selector_that_does_not_compile_is_refused_once():
    with pytest.raises(claimspec.ClaimSpecError) as raised:
        claimspec.check_class({"kind": "DeviceClass", "metadata": {"name": "broken"},
                               "spec": {"selectors": [{"cel": {"expression": "device.driver =="}}]}})
    assert str(raised.value).startswith('DeviceClass.resource.k8s.io "broken" is invalid: '
                                        'spec.selectors[0].cel.expression: Invalid value: "device.driver ==": '
                                        "compilation failed: ERROR: <input>:1:")


def test_the_demo_reads_a_v1beta1_claim_in_v1_form(tmp_path):
    path = tmp_path / "beta.yaml"
    path.write_text(yaml.safe_dump(claim("v1beta1", OLD_STYLE)))
    (read,), _ = from_file(path)
    assert read.spec["devices"]["requests"][0]["exactly"]["count"] == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "driver", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=180)


@pytest.mark.parametrize("command", [["demo", "--claim"], ["explain", "--mock", "mixed", "-f"]],
                         ids=["demo", "explain"])
def test_a_v1_claim_in_v1beta1_layout_is_one_line_not_a_traceback_or_fits(tmp_path, command):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(claim("v1", OLD_STYLE)))
    done = _cli(*command, str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and "fits" not in done.stdout
    assert "strict decoding error: " in line
    assert 'unknown field "spec.devices.requests[0].deviceClassName"' in line


def test_explain_of_a_v1beta1_claim_file_judges_it_as_v1(tmp_path):
    path = tmp_path / "beta.yaml"
    path.write_text(yaml.safe_dump(claim("v1beta1", OLD_STYLE)))
    done = _cli("explain", "--mock", "mixed", "-f", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fits on 1 of 1 node(s)" in done.stdout


def test_explain_reports_a_bad_selector_once_before_any_device(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(claim("v1", [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.accel.dra.io", "selectors": [{"cel": {"expression": "device.driver =="}}]}}])))
    done = _cli("explain", "--mock", "mixed", "-f", str(path))
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("dra-driver explain: bad.yaml: ResourceClaim.resource.k8s.io \"c\" is invalid: "
                               "spec.devices.requests[0].exactly.selectors[0].cel.expression: ")
    assert lines[1:] == [" | device.driver ==", " | ...............^"]
