"""Messages that lead somewhere (issue 40, item 5): what a user reads when something does
not fit or is not there names what was searched and what to run next."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

THREE_GPUS = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: three-gpus}
spec:
  devices:
    requests:
      - {name: gpu, exactly: {deviceClassName: gpu.accel.dra.io, count: 3}}
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "driver", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=180)


def test_explain_of_a_claim_not_in_a_mock_names_the_mock_and_asks_for_the_file():
    done = _cli("explain", "nosuch", "--mock", "mixed")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("dra-driver explain: --mock mixed: no ResourceClaim or ResourceClaimTemplate "
                           "'nosuch'"), line
    assert "--slices" not in line  # none were given
    assert "-f FILE" in line


def test_a_demo_claim_that_does_not_fit_points_to_explain_and_to_profiles_where_it_fits(tmp_path):
    from driver import demo

    claim = tmp_path / "three-gpus.yaml"
    claim.write_text(THREE_GPUS)
    out: list[str] = []
    err: list[str] = []
    code = demo.main("mixed", out=out.append, err=err.append, claim_file=claim, cdi_root=tmp_path / "cdi")
    assert code == 1
    (line,) = err
    assert line.startswith("dra-driver demo: claim three-gpus cannot be allocated on profile mixed: ")
    assert f"`dra-driver explain -f {claim} --mock mixed` says why" in line
    # mixed has 2 GPUs; h100x8 has 8 and l4 4, a100-mig 2 whole ones beside its MIG devices.
    assert f"it fits profiles h100x8, l4 (`dra-driver demo --claim {claim} --profile h100x8`)" in line
    # A claim that does not fit is not the driver's failure: no log kept, no folder left.
    work = Path(out[0].split("driver state in ", 1)[1])
    assert not work.exists()


def test_status_on_a_node_without_devices_says_so_instead_of_a_bare_header(tmp_path):
    sysfs = tmp_path / "sys"
    (sysfs / "bus" / "pci" / "devices").mkdir(parents=True)
    (sysfs / "class").mkdir()
    done = _cli("status", "--sysfs-root", str(sysfs), "--state-dir", str(tmp_path / "state"),
                "--node-name", "node-a")
    assert done.returncode == 0
    assert done.stdout == ""
    assert (f"dra-driver status: no GPU, FPGA or NIC found on node node-a (--sysfs-root {sysfs}); "
            "`dra-driver discover` lists what it sees and what it left out") in done.stderr.splitlines()
