"""Checks of the directories and the API server configuration a command is about to
use, before it starts.

Each problem becomes one ConfigError that names the option and says what is wrong (a
file where a directory belongs, a read-only mount, a path under /proc, a kubeconfig that
is not one), instead of a traceback from deep inside start-up. Missing directories are
created, as the kubelet's own directories are on a fresh node, but only once every check
passed: a rejected start leaves the host as it was.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Mapping

from driver.service.config import ConfigError, Config
from driver.kube.kubeconfig import SERVICE_ACCOUNT, ClientConfigError, check_kubeconfig, in_cluster

VIRTUAL = (Path("/proc"), Path("/sys"), Path("/dev"))


def usable_directory(path: Path, option: str) -> None:
    """Could the driver make and write this directory? Answered without creating anything:
    the nearest existing ancestor must be a writable directory on a writable mount."""
    resolved = path.resolve()
    for virtual in VIRTUAL:
        if resolved == virtual or resolved.is_relative_to(virtual):
            raise ConfigError(f"{option} {path}: is under {virtual}, a kernel file system, "
                              "not a place for the driver's files")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path}: exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option} {path}: cannot be created: {existing} is not a directory")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise ConfigError(f"{option} {path}: is read-only" if existing == path else
                          f"{option} {path}: cannot be created: {existing} is read-only")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: is not writable" if existing == path else
                          f"{option} {path}: cannot be created: {existing} is not writable")


def writable_directory(path: Path, option: str) -> None:
    usable_directory(path, option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot be created: {err.strerror}") from err
    try:
        _probe_write(path)
    except OSError as err:
        why = "is read-only" if err.errno == errno.EROFS else f"is not writable: {err.strerror}"
        raise ConfigError(f"{option} {path}: {why}") from err


def _probe_write(path: Path) -> None:
    """Write a file in `path` that never gets a name there (O_TMPFILE): the kubelet's plugin
    watcher stats every file created in plugins_registry before it ignores dot-names, and a
    named probe file removed at once gets an error line in the kubelet's log ("stat file
    ... no such file or directory"). A filesystem without O_TMPFILE gets a named probe."""
    try:
        fd = os.open(path, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    else:
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        return
    probe = path / f".dra-driver-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def existing_directory(path: Path, option: str) -> None:
    if not path.exists():
        raise ConfigError(f"{option} {path}: does not exist")
    if not path.is_dir():
        raise ConfigError(f"{option} {path}: is not a directory")


def free_port(port: int, option: str) -> None:
    """Bind and release: a port taken by another process fails here, before start-up logs
    anything (the plugin's own bind still reports a port lost to a race)."""
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as err:
            raise ConfigError(port_problem(err, port, option)) from err


def port_problem(err: OSError, port: int, option: str) -> str:
    why = "is already in use" if err.errno == errno.EADDRINUSE else f"cannot be opened ({err.strerror})"
    return (f"{option} {port}: the port {why}; another process in this network namespace holds "
            "it (pick another port, or 0 to disable)")


def api_configuration(kubeconfig: Path | None, environ: Mapping[str, str] = os.environ,
                      account: Path = SERVICE_ACCOUNT) -> None:
    """The mistakes in the API server configuration that reading it shows, found by the
    loader the client uses (driver/kube/kubeconfig.py), run dry. `dra-driver run` makes its
    client only after it has offered the kubelet its registration socket; what only making
    the client finds (a client certificate that is not PEM, an exec plugin that fails) is
    then still one line and exit 2, but after start-up began."""
    try:
        if kubeconfig is None:
            in_cluster(environ, account)  # reads the service account, keeps nothing
        else:
            check_kubeconfig(kubeconfig, environ)
    except ClientConfigError as err:
        raise ConfigError(str(err)) from err


RUN_DIRECTORIES = (("kubelet_registrar_dir", "--kubelet-registrar-dir"),
                   ("kubelet_plugins_dir", "--kubelet-plugins-dir"),
                   ("state_dir", "--state-dir"), ("cdi_root", "--cdi-root"))


def for_run(config: Config) -> None:
    """`dra-driver run` writes into these; mock mode generates its own device trees.
    Everything is checked before anything is made: a bad kubeconfig or a taken port leaves
    the host as it was, no directory created (the directories last, and made only once
    every check passed)."""
    for_discover(config)
    api_configuration(config.kubeconfig)
    free_port(config.metrics_port, "--metrics-port")
    free_port(config.healthz_port, "--healthz-port")
    for attribute, option in RUN_DIRECTORIES:
        usable_directory(getattr(config, attribute), option)
    for attribute, option in RUN_DIRECTORIES:
        writable_directory(getattr(config, attribute), option)


def for_discover(config: Config) -> None:
    if config.mock is not None:
        return
    existing_directory(config.sysfs_root, "--sysfs-root")
    existing_directory(config.proc_root, "--proc-root")
