"""`dra-driver run` checks its whole configuration before it touches the host: a missing
or unusable kubeconfig, a CA file that is missing or not a certificate, a port in use end
it with one line and exit 2, and no directory or file of its own exists afterwards
(issue 29.7: it used to leave the kubelet directories, or generate the mock tree and
start the plugin, before failing)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CASES = ["no kubeconfig", "garbage kubeconfig", "CA file missing", "CA not a certificate",
         "client certificate missing", "metrics port in use"]


def _kubeconfig(path, **cluster):
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443", **cluster}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}))
    return path


@pytest.mark.parametrize("case", CASES)
def test_run_rejects_its_configuration_before_it_creates_anything(case, tmp_path):
    # Every directory of the driver lies below this, none exists; short, since the socket
    # paths under it must fit the 107-byte limit whatever tmp_path is.
    short = Path(tempfile.mkdtemp(prefix="dra-v-", dir="/tmp"))
    root = short / "host"
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    args = [sys.executable, "-m", "driver", "run", "--mock", "mixed", "--node-name", "n",
            "--kubelet-registrar-dir", str(root / "plugins_registry"),
            "--kubelet-plugins-dir", str(root / "plugins"), "--cdi-root", str(root / "cdi"),
            "--metrics-port", "0", "--healthz-port", "0"]
    holder = None
    if case == "garbage kubeconfig":
        (tmp_path / "kubeconfig").write_text("garbage: [\n")
        args += ["--kubeconfig", str(tmp_path / "kubeconfig")]
    elif case == "CA file missing":
        args += ["--kubeconfig", str(_kubeconfig(tmp_path / "kubeconfig",
                                                 **{"certificate-authority": "/nonexistent/ca.crt"}))]
    elif case == "CA not a certificate":
        (tmp_path / "ca.crt").write_text("not a certificate\n")
        args += ["--kubeconfig", str(_kubeconfig(tmp_path / "kubeconfig",
                                                 **{"certificate-authority": "ca.crt"}))]
    elif case == "client certificate missing":
        config = json.loads(_kubeconfig(tmp_path / "kubeconfig").read_text())
        config["users"][0]["user"] = {"client-certificate": "/nonexistent/c.crt",
                                      "client-key": "/nonexistent/c.key"}
        (tmp_path / "kubeconfig").write_text(json.dumps(config))
        args += ["--kubeconfig", str(tmp_path / "kubeconfig")]
    elif case == "metrics port in use":
        holder = socket.socket()
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        args[args.index("--metrics-port") + 1] = str(holder.getsockname()[1])
        args += ["--kubeconfig", str(_kubeconfig(tmp_path / "kubeconfig"))]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    finally:
        if holder is not None:
            holder.close()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.startswith("dra-driver: configuration error: ") and \
        len(done.stderr.strip().splitlines()) == 1, done.stderr
    made = sorted(str(p) for p in root.rglob("*"))[:10] if root.exists() else None
    shutil.rmtree(short, ignore_errors=True)
    assert made is None, made
    if case.startswith("CA"):
        assert "certificate-authority" in done.stderr
