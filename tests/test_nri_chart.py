"""The chart's NRI switch: the socket and the pods' namespaces mounted, the option set."""

from __future__ import annotations

import pytest

from tests.test_chart import by_kind, render


def plugin_container(objects):
    ds = by_kind(objects, "DaemonSet")[0]
    spec = ds["spec"]["template"]["spec"]
    container = next(c for c in spec["containers"] if c["name"] == "plugin")
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    return env, mounts, volumes


def test_nri_is_off_by_default() -> None:
    env, mounts, _ = plugin_container(render())
    assert "NRI_SOCKET" not in env and "/var/run/netns" not in mounts


def test_nri_on_mounts_the_socket_and_the_namespaces() -> None:
    env, mounts, volumes = plugin_container(render({"nri": {"enabled": True}}))
    assert env["NRI_SOCKET"] == "/var/run/nri/nri.sock"
    assert volumes[mounts["/var/run/nri"]["name"]]["hostPath"]["path"] == "/var/run/nri"
    netns = mounts["/var/run/netns"]
    assert netns["mountPropagation"] == "HostToContainer"
    assert volumes[netns["name"]]["hostPath"]["path"] == "/var/run/netns"


def test_another_socket_path_is_mounted_by_its_directory() -> None:
    env, mounts, _ = plugin_container(render({"nri": {"enabled": True,
                                                      "socket": "/run/crio/nri/nri.sock"}}))
    assert env["NRI_SOCKET"] == "/run/crio/nri/nri.sock" and "/run/crio/nri" in mounts


def test_nri_without_privileges_is_refused_at_render() -> None:
    with pytest.raises(Exception, match="nri.enabled needs privileged: true"):
        render({"nri": {"enabled": True}, "privileged": False})


def test_a_runtime_that_keeps_namespaces_elsewhere_gets_that_directory_mounted() -> None:
    dirs = ["/var/run/netns", "/run/containerd/io.containerd.grpc.v1.cri/netns"]
    _, mounts, volumes = plugin_container(render({"nri": {"enabled": True, "netnsDirs": dirs}}))
    for path in dirs:
        assert mounts[path]["mountPropagation"] == "HostToContainer"
        assert volumes[mounts[path]["name"]]["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}


@pytest.mark.parametrize("dirs", [[], ["relative/netns"], ["/var/run/netns/"], ["/a", "/a"]])
def test_bad_namespace_directories_are_refused(dirs) -> None:
    with pytest.raises(Exception, match="netnsDirs"):
        render({"nri": {"enabled": True, "netnsDirs": dirs}})
