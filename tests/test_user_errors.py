"""What a user gets for a mistake: exit 2, one line on stderr that names the option and the
problem, never a traceback, and nothing started."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import available as netns_available

RUN = ["run", "--node-name", "n", "--mock", "mixed", "--metrics-port", "0", "--healthz-port", "0"]


def dirs(tmp: Path) -> list[str]:
    return ["--kubelet-registrar-dir", str(tmp / "reg"), "--kubelet-plugins-dir", str(tmp / "plugins"),
            "--cdi-root", str(tmp / "cdi"), "--state-dir", str(tmp / "state")]


def kubeconfig(tmp: Path) -> Path:
    path = tmp / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: "
                    "{server: 'http://127.0.0.1:1'}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
                    "users: [{name: u, user: {token: t}}]\n")
    return path


def with_option(base: list[str], option: str, value: str) -> list[str]:
    """`base` with `option` set to `value` (replacing the default the table starts from)."""
    if option in base:
        i = base.index(option)
        return base[:i] + [option, value] + base[i + 2:]
    return base + [option, value]


def busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen(1)
    return sock


def cases(tmp: Path):
    a_file = tmp / "a-file"
    a_file.write_text("x")
    bad_yaml = tmp / "bad-kubeconfig"
    bad_yaml.write_text("clusters: [unclosed\n")
    not_config = tmp / "list-kubeconfig"
    not_config.write_text("- just\n- a list\n")
    dup = tmp / "dup.yaml"
    dup.write_text("roots: [{devices: [{type: nic, model: e810, ifName: eth1}, "
                   "{type: nic, model: e810, ifName: eth1}]}]\n")
    base = RUN + dirs(tmp) + ["--kubeconfig", str(kubeconfig(tmp))]
    yield "cdi-root is a file", with_option(base, "--cdi-root", str(a_file)), {}, \
        f"--cdi-root {a_file}: exists and is not a directory"
    yield "state-dir under /proc", with_option(base, "--state-dir", "/proc/dra-state"), {}, \
        "--state-dir /proc/dra-state: is under /proc, a kernel file system"
    yield "registrar dir cannot be created", with_option(base, "--kubelet-registrar-dir", str(a_file / "sub")), {}, \
        f"--kubelet-registrar-dir {a_file / 'sub'}: cannot be created: {a_file} is not a directory"
    yield "plugins dir is a file", with_option(base, "--kubelet-plugins-dir", str(a_file)), {}, \
        f"--kubelet-plugins-dir {a_file}: exists and is not a directory"
    yield "same port twice", with_option(with_option(base, "--metrics-port", "9555"), "--healthz-port", "9555"), {}, \
        "--metrics-port and --healthz-port: both are 9555"
    yield "kubeconfig not YAML", with_option(base, "--kubeconfig", str(bad_yaml)), {}, \
        f"kubeconfig {bad_yaml}: not a usable kubeconfig file"
    yield "kubeconfig not a config", with_option(base, "--kubeconfig", str(not_config)), {}, \
        f"kubeconfig {not_config}: not a usable kubeconfig file"
    yield "kubeconfig is a directory", with_option(base, "--kubeconfig", str(tmp)), {}, \
        f"--kubeconfig: {tmp} is a directory, not a kubeconfig file"
    yield "kubeconfig missing", with_option(base, "--kubeconfig", "nope/config"), {}, \
        f"--kubeconfig: kubeconfig file not found: {Path.cwd() / 'nope/config'}"
    no_kubeconfig = [a for a in base if a != "--kubeconfig" and a != str(tmp / "kubeconfig")]
    yield "KUBECONFIG list of missing files", no_kubeconfig, {"KUBECONFIG": "/nope/a:/nope/b"}, \
        "$KUBECONFIG: none of the kubeconfig files exists: /nope/a, /nope/b"
    yield "duplicate NIC names in a mock profile", with_option(base, "--mock", str(dup)), {}, \
        "interface name 'eth1' is already used by roots[0].devices[0].ifName"
    yield "discover on a missing sysfs root", ["discover", "--sysfs-root", "/nonexistent"], {}, \
        "--sysfs-root /nonexistent: does not exist"
    yield "cleanup outside a cluster", ["cleanup", "--node-name", "n"], {"KUBECONFIG": ""}, \
        "not in a cluster and no kubeconfig given"
    yield "run outside a cluster", no_kubeconfig, {"KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": ""}, \
        "not in a cluster and no kubeconfig given (Service host/port is not set.)"
    yield "an option the command does not take", ["discover", "--cdi-root", "/x"], {}, \
        "unrecognized arguments: --cdi-root /x"


CASE_NAMES = [
    "cdi-root is a file", "state-dir under /proc", "registrar dir cannot be created",
    "plugins dir is a file", "same port twice", "kubeconfig not YAML", "kubeconfig not a config",
    "kubeconfig is a directory", "kubeconfig missing", "KUBECONFIG list of missing files",
    "duplicate NIC names in a mock profile", "discover on a missing sysfs root",
    "cleanup outside a cluster", "run outside a cluster", "an option the command does not take",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_user_errors_are_one_line_exit_2(name, tmp_path):
    _, argv, env, expected = next(c for c in cases(tmp_path) if c[0] == name)
    env = {k: v for k, v in dict(os.environ, **env).items() if v != ""}
    proc = subprocess.run([sys.executable, "-m", "driver", *argv], capture_output=True, text=True,
                          timeout=60, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and expected in lines[0], lines
    assert "Traceback" not in proc.stderr + proc.stdout


def test_port_in_use_is_named(tmp_path):
    taken = busy_port()
    try:
        port = taken.getsockname()[1]
        argv = with_option(RUN + dirs(tmp_path) + ["--kubeconfig", str(kubeconfig(tmp_path))],
                           "--healthz-port", str(port))
        proc = subprocess.run([sys.executable, "-m", "driver", *argv], capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"dra-driver: configuration error: --healthz-port {port}: the port is already in use; another "
        "process in this network namespace holds it (pick another port, or 0 to disable)"]


@pytest.mark.skipif(netns_available() is not None, reason="needs unshare (mount namespaces)")
def test_read_only_directory_is_named(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    argv = with_option(RUN + dirs(tmp_path) + ["--kubeconfig", str(kubeconfig(tmp_path))],
                       "--kubelet-registrar-dir", str(ro))
    script = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && "
              f"exec {shlex.join([sys.executable, '-m', 'driver', *argv])}")
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"dra-driver: configuration error: --kubelet-registrar-dir {ro}: is read-only"]


def test_relative_kubeconfig_and_lists_as_kubectl_reads_them(tmp_path, monkeypatch):
    import argparse

    from driver.service.config import CLEANUP, add_arguments, build

    good = kubeconfig(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser, CLEANUP)
    relative = build(parser.parse_args(["--node-name", "n", "--kubeconfig", "kubeconfig"]), {},
                     command=CLEANUP, cwd=tmp_path)
    assert relative.kubeconfig == good
    listed = build(parser.parse_args(["--node-name", "n"]),
                   {"KUBECONFIG": f"{tmp_path}/missing:kubeconfig:{tmp_path}/other"}, command=CLEANUP, cwd=tmp_path)
    assert listed.kubeconfig == good, "the first file of the list that exists"


def test_help_a_user_can_read():
    def help_of(*args):
        proc = subprocess.run([sys.executable, "-m", "driver", *args, "--help"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0
        return proc.stdout

    top = help_of()
    assert "Dynamic Resource Allocation (DRA) driver for GPUs, FPGAs and" in " ".join(top.split())
    for command in ("run", "discover", "cleanup", "demo"):
        assert f"    {command} " in top, command
    discover = help_of("discover")
    assert "{table,yaml,json}" in discover and "ResourceSlices" in discover
    assert "--cdi-root" not in discover and "--kubeconfig" not in discover, "only the options it uses"
    assert "(default: accel.dra.io)" in discover
    cleanup = help_of("cleanup")
    assert "--kubeconfig" in cleanup and "--mock" not in cleanup
    demo = help_of("demo")
    assert "--claim FILE" in demo and "sriov-large" in demo and "(default: mixed)" in demo
    run = help_of("run")
    assert "--registration-timeout" in run and "(default: 9400)" in run and "env METRICS_PORT" in run
