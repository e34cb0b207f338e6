from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from driver import cli
from driver.service.config import ConfigError, add_arguments, build


def parse(argv, env=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build(parser.parse_args(argv), env or {})


def test_defaults():
    config = parse(["--node-name", "node-1"])
    assert config.driver_name == "accel.dra.io"
    assert config.kubelet_registrar_dir == Path("/var/lib/kubelet/plugins_registry")
    assert config.dra_socket == Path("/var/lib/kubelet/plugins/accel.dra.io/dra.sock")
    assert config.registration_socket == Path("/var/lib/kubelet/plugins_registry/accel.dra.io-reg.sock")
    assert config.state_dir == Path("/var/lib/kubelet/plugins/accel.dra.io")
    assert config.sysfs_root == Path("/sys") and config.dev_root == Path("/dev")
    assert config.mock is None and config.metrics_port == 9400
    assert config.nic_filter.exclude_default_route is True
    assert config.claim_workers == 32  # not the host's CPU count: the same on every node


def test_flags_beat_env_beat_defaults():
    env = {"NODE_NAME": "from-env", "DRIVER_NAME": "gpu.example.com", "METRICS_PORT": "8080",
           "CLAIM_WORKERS": "8"}
    config = parse(["--node-name", "from-flag"], env)
    assert config.claim_workers == 8
    assert config.node_name == "from-flag"
    assert config.driver_name == "gpu.example.com"
    assert config.metrics_port == 8080


def test_seamless_upgrade_socket_names():
    config = parse(["--node-name", "n", "--pod-uid", "1F0C7A52-8F7E-4D5B-9C1A-0B2C3D4E5F60"])
    assert config.dra_socket.name == "dra-1f0c7a52-8f7e-4d5b-9c1a-0b2c3d4e5f60.sock"
    assert config.registration_socket.name == "accel.dra.io-1f0c7a52-8f7e-4d5b-9c1a-0b2c3d4e5f60-reg.sock"


def test_long_names_fall_back_to_hashes_like_the_upstream_helper():
    uid = "1f0c7a52-8f7e-4d5b-9c1a-0b2c3d4e5f60"
    driver = "gpu-accelerators.infrastructure.examples"  # 40 characters
    config = parse(["--node-name", "n", "--driver-name", driver, "--pod-uid", uid])
    registration, dra = config.registration_socket, config.dra_socket
    # The full names would not fit below the kubelet's default directories ...
    assert len(f"/var/lib/kubelet/plugins_registry/{driver}-{uid}-reg.sock") > 107
    assert len(f"/var/lib/kubelet/plugins/{driver}/dra-{uid}.sock") > 107
    # ... a short hash of the pod UID does, and is stable for the same UID.
    assert registration.parent == Path("/var/lib/kubelet/plugins_registry")
    assert registration.name.startswith(f"{driver}-") and registration.name.endswith("-reg.sock")
    assert len(registration.name) == len(driver) + 1 + 8 + len("-reg.sock") and uid not in registration.name
    assert dra.parent == Path(f"/var/lib/kubelet/plugins/{driver}") and len(dra.name) == len("dra-.sock") + 8
    assert len(str(registration)) <= 107 and len(str(dra)) <= 107
    again = parse(["--node-name", "n", "--driver-name", driver, "--pod-uid", uid])
    assert (again.registration_socket, again.dra_socket) == (registration, dra)
    other = parse(["--node-name", "n", "--driver-name", driver, "--pod-uid", uid.replace("1f", "2f")])
    assert other.registration_socket != registration and other.dra_socket != dra
    # Longer directories: the last form, a hash of driver and UID.
    deep = parse(["--node-name", "n", "--driver-name", driver, "--pod-uid", uid,
                  "--kubelet-registrar-dir", "/var/lib/kubelet-with-a-much-longer-root/plugins_registry"])
    assert deep.registration_socket.name.startswith("dra-") and len(str(deep.registration_socket)) <= 107


def test_driver_root_mount_defaults_to_the_driver_root():
    config = parse(["--node-name", "n", "--nvidia-driver-root", "/run/nvidia/driver"])
    assert config.nvidia_driver_root == config.nvidia_driver_root_mount == Path("/run/nvidia/driver")
    config = parse(["--node-name", "n"], {"NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
                                          "NVIDIA_DRIVER_ROOT_MOUNT": "/driver-root"})
    assert (config.nvidia_driver_root, config.nvidia_driver_root_mount) == (
        Path("/run/nvidia/driver"), Path("/driver-root"))


def test_nic_filters_parsed():
    config = parse(["--node-name", "n", "--nic-exclude", "eno*, vendor=0x8086",
                    "--nic-allow-default-route", "true"])
    assert [str(s) for s in config.nic_filter.exclude] == ["eno*", "vendor=0x8086"]
    assert config.nic_filter.exclude_default_route is False


@pytest.mark.parametrize("argv, fragment", [
    (["--driver-name", "Bad_Name"], "--driver-name: driver name 'Bad_Name'"),
    (["--driver-name", "a" * 64 + ".io"], "at most 63"),
    (["--cdi-root", "relative/cdi"], "--cdi-root: 'relative/cdi' must be an absolute path"),
    (["--mock", "no-such-profile"], "--mock: mock profile 'no-such-profile'"),
    (["--metrics-port", "99999"], "--metrics-port: 99999 is not a port number"),
    (["--log-format", "xml"], "--log-format: 'xml'"),
    (["--nic-exclude", "vendor=zz"], "--nic-exclude: NIC selector 'vendor=zz'"),
    (["--node-name", "Not_A_Node"], "--node-name: node name"),
    (["--mock", "mixed", "--sysfs-root", "/x"], "--sysfs-root: mock mode generates"),
    (["--mock", "mixed", "--nvidia-driver-root", "/x"], "--nvidia-driver-root: mock mode generates"),
    (["--nvidia-driver-root", "run/nvidia"], "--nvidia-driver-root: 'run/nvidia' must be an absolute path"),
    (["--kubelet-plugins-dir", "/" + "p" * 100], "--kubelet-plugins-dir: the DRA socket path .* longer than 107 bytes"),
    (["--kubelet-registrar-dir", "/" + "r" * 100], "--kubelet-registrar-dir: the registration socket path"),
    (["--driver-name", "1accel.example.com"], "is also the CDI vendor name, which must start with a letter"),
    (["--metrics-port", "9401"], "--metrics-port and --healthz-port default: both are 9401"),
    (["--registration-timeout", "0"], "--registration-timeout: 0.0 is outside"),
    (["--claim-workers", "0"], "--claim-workers: 0 is outside 1..256 threads"),
    (["--claim-workers", "many"], "--claim-workers: 'many' is not a number of threads"),
    (["--mps-shm-size", "lots"], "--mps-shm-size: 'lots' is not a quantity"),
    (["--mps-shm-size", "4Ki"], "--mps-shm-size: '4Ki' is below 1Mi"),
    (["--mig-mode", "dynamic", "--mig-profiles", "1g.10gb,3g"], "--mig-profiles: '3g' is not a MIG GPU instance profile"),
    (["--mig-profiles", "1g.10gb"], "--mig-profiles: chooses the profiles of dynamic MIG; --mig-mode default is static"),
])
def test_invalid_values_are_named(argv, fragment):
    argv = ["--node-name", "n", *argv] if "--node-name" not in argv else argv
    pattern = fragment if ".*" in fragment else fragment.replace("(", r"\(").replace("*", r"\*")
    with pytest.raises(ConfigError, match=pattern):
        parse(argv)


def test_mig_profiles_parsed():
    config = parse(["--node-name", "n", "--mig-mode", "dynamic", "--mig-profiles", " 1g.10gb, 1G.10GB+ME,7g.80gb,"])
    assert config.mig_profiles == frozenset({"1g.10gb", "1g.10gb+me", "7g.80gb"})
    assert parse(["--node-name", "n", "--mig-mode", "dynamic"]).mig_profiles == frozenset()


def test_env_errors_name_the_variable():
    with pytest.raises(ConfigError, match=r"\$CDI_ROOT"):
        parse(["--node-name", "n"], {"CDI_ROOT": "cdi"})


def test_bad_mock_file_is_named(tmp_path):
    bad = tmp_path / "node.yaml"
    bad.write_text("roots:\n  - devices:\n      - {type: gpu, model: h100-sxm5-80gb, mig: [9g.1tb]}\n")
    with pytest.raises(ConfigError, match=f"{bad}: roots\\[0\\].devices\\[0\\].mig"):
        parse(["--node-name", "n", "--mock", str(bad)])


def test_custom_mock_file_discovers(tmp_path, capsys):
    profile = tmp_path / "lab.yaml"
    profile.write_text("roots:\n  - numa: 0\n    devices:\n      - {type: nic, model: e810, vfs: 2}\n")
    assert cli.main(["discover", "--mock", str(profile), "--node-name", "lab"]) == 0
    out = capsys.readouterr().out
    assert "nic-0000-11-00-0" in out and "nic-0000-11-00-3" in out


def test_cli_exits_2_with_one_message():
    proc = subprocess.run([sys.executable, "-m", "driver", "discover", "--driver-name", "Bad.Name"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dra-driver: configuration error: --driver-name: driver name 'Bad.Name' must be a lower-case "
        "DNS subdomain of at most 63 characters, e.g. accel.example.com"
    ]


NIC = "{type: nic, model: connectx-7"


@pytest.mark.parametrize("yaml_text, fragment", [
    (f"roots: [{{devices: [{NIC}, rdma: \"false\"}}]}}]", "roots[0].devices[0].rdma: must be true or false (a YAML boolean), got 'false'"),
    ("nvidia: {driverVersion: 550.54}\nroots: [{devices: [{type: gpu, model: l4}]}]", "nvidia.driverVersion: must be a string (quote it), got 550.54"),
    ("nvidia: {}\nroots: [{devices: [{type: gpu, model: l4, lost: 1}]}]", "roots[0].devices[0].lost: must be true or false"),
    ("roots: [{devices: [{type: dfl, model: d5005, afuId: not-hex}]}]", "roots[0].devices[0].afuId: must be 32 hexadecimal digits"),
    ("roots: [{devices: [{type: gpu, model: h100}]}]", "unknown model 'h100'; known: a100-sxm4-40gb, a100-sxm4-80gb, h100-sxm5-80gb, h200, l4"),
    ("roots: [{devices: [{type: 7}]}]", "roots[0].devices[0].type: must be gpu, nic, alveo or dfl"),
    ("description: [a]\nroots: []", "description: must be a string"),
    (f"roots: [{{devices: [{NIC}, ifName: eth9}}, {NIC}, ifName: eth9}}]}}]", "roots[0].devices[1].ifName: interface name 'eth9' is already used by roots[0].devices[0].ifName"),
    (f"roots: [{{repeat: 2, devices: [{NIC}, ifName: eth9}}]}}]", "already used by roots[0].devices[0].ifName (the root repeats)"),
    (f"managementNic: {{model: i350, ifName: eno1}}\nroots: [{{devices: [{NIC}, ifName: eno1}}]}}]", "already used by managementNic.ifName"),
])
def test_mock_profiles_are_validated_strictly(tmp_path, yaml_text, fragment):
    path = tmp_path / "node.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as caught:
        parse(["--node-name", "n", "--mock", str(path)])
    assert fragment in str(caught.value) and str(path) in str(caught.value)


def test_docs_list_every_mock_model():
    from driver.devices.mock import catalog
    from tests.conftest import REPO

    assert catalog.markdown_table() in (REPO / "docs" / "mock-profiles.md").read_text()
