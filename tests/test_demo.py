"""The README's demo runs end to end (with a real container where podman can run)."""

from __future__ import annotations

import os
import subprocess
import sys

from driver.demo import podman_ready


def test_demo_runs():
    proc = subprocess.run([sys.executable, "-m", "driver", "demo"], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "talking v1.DRAPlugin" in out
    assert "published 11 devices in 3 ResourceSlices" in out
    assert "allocated: gpu -> gpu-0000-11-00-0, nic -> nic-0000-12-00-0" in out, "aligned on pci0000:10"
    assert "allocated: fpga -> fpga-0000-31-00-1" in out
    assert "unprepared 3 claims; CDI specs left: 0" in out
    if podman_ready() is None or os.environ.get("CI"):
        assert out.count("container saw:") == 3
        assert "DRA_NIC_0000_12_00_0_RDMA_DEVICE=mlx5_0" in out and "/dev/nvidia0" in out
        assert "NCCL_IB_HCA=auto" in out, "the claim's opaque config reached the container"
