"""`dra-driver explain` on inputs the cluster itself would refuse: an API server that cannot
be reached or serves no resource.k8s.io (one line, exit 2: not a verdict), and claims
whose opaque configs for this driver the admission policy and prepare reject (issue 29)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest
import yaml

from tests.conftest import REPO
from tests.test_config_policy import BAD, GOOD
from tests.test_explain import run

DRIVER = "accel.dra.io"


def kubeconfig(path, server: str):
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}))
    return path


class _NoDra(http.server.BaseHTTPRequestHandler):
    """An API server of a cluster without resource.k8s.io: 404 for its group."""

    def do_GET(self):
        body = json.dumps({"kind": "Status", "status": "Failure", "reason": "NotFound",
                           "code": 404, "message": "the server could not find the requested resource"})
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def no_dra_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoDra)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize("case", ["refused", "no resource.k8s.io"])
@pytest.mark.parametrize("how", ["claim", "-f"])
def test_an_unusable_cluster_is_one_line_and_exit_2(case, how, tmp_path, no_dra_server):
    server = f"http://127.0.0.1:{_free_port()}" if case == "refused" else no_dra_server
    config = kubeconfig(tmp_path / "kubeconfig", server)
    target = ["some-claim"] if how == "claim" else ["-f", str(REPO / "examples" / "gpu-single" / "claim.yaml")]
    done = subprocess.run([sys.executable, "-m", "driver", "explain", *target, "--kubeconfig", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("dra-driver explain: ") and server in done.stderr
    if case == "refused":
        assert "cannot reach" in done.stderr and "Connection refused" in done.stderr
    else:
        assert "does not serve resource.k8s.io" in done.stderr


def _claim_file(tmp_path, parameters, requests=("gpu",)) -> str:
    config = {"opaque": {"driver": DRIVER, "parameters": parameters}}
    if requests:
        config["requests"] = list(requests)
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}],
                                  "config": [config]}}}
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(claim))
    return str(path)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_config_the_policy_rejects_fits_nowhere_and_says_why(name, tmp_path):
    """The same table of bad configs as the admission policy's test: every one is a claim
    that cannot be prepared anywhere (exit 1), with the decoder's reason."""
    code, out, err = run("-f", _claim_file(tmp_path, BAD[name], requests=()), "--mock", "mixed", "-o", "json")
    assert code == 1, (out, err)
    (claim,) = json.loads(out)["claims"]
    assert not claim["fits"]
    assert all(n["why"].startswith("invalid opaque config: config #0 for accel.dra.io: ") and
               "admission policy" in n["why"] for n in claim["nodes"]), claim["nodes"]


@pytest.mark.parametrize("name", sorted(GOOD))
def test_a_config_the_policy_accepts_changes_nothing(name, tmp_path):
    code, out, _ = run("-f", _claim_file(tmp_path, GOOD[name], requests=()), "--mock", "mixed")
    assert code == 0 and "invalid opaque config" not in out, out


def test_the_issues_three_configs(tmp_path):
    """Unknown GpuConfig fields, an unknown kind, defaultActiveThreadPercentage 250."""
    for parameters, fragment in [
        ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "colour": "red"},
         "GpuConfig: unknown field(s) colour"),
        ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "TpuConfig"}, "unknown kind 'TpuConfig'"),
        ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig",
          "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 250}}},
         "defaultActiveThreadPercentage must be an integer from 1 to 100, got 250")]:
        code, out, _ = run("-f", _claim_file(tmp_path, parameters), "--mock", "mixed")
        assert code == 1 and "Node mock-node: does not fit: invalid opaque config: config #0 for " \
            "accel.dra.io (requests gpu): " in out and fragment in out, out
        assert "Suggestions:\n  - fix the opaque config: " in out


def test_a_config_aimed_at_a_request_of_another_kind_fails_prepare(tmp_path):
    """What prepare says: a NicConfig aimed at the GPU request cannot configure a GPU."""
    code, out, _ = run("-f", _claim_file(tmp_path, {"apiVersion": "accel.dra.io/v1alpha1",
                                                    "kind": "NicConfig"}), "--mock", "mixed")
    assert code == 1
    assert "does not fit: prepare would fail: NicConfig cannot configure gpu device gpu-" in out
    # Claim-wide (no requests), it applies to the NICs only and the GPU gets the default.
    code, out, _ = run("-f", _claim_file(tmp_path, {"apiVersion": "accel.dra.io/v1alpha1",
                                                    "kind": "NicConfig"}, requests=()), "--mock", "mixed")
    assert code == 0, out


def test_another_drivers_config_is_not_ours_to_judge(tmp_path):
    path = _claim_file(tmp_path, {"anything": "goes"}, requests=())
    text = open(path).read().replace("driver: accel.dra.io", "driver: gpu.example.com")
    open(path, "w").write(text)
    code, out, _ = run("-f", path, "--mock", "mixed")
    assert code == 0, out
