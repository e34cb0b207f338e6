"""What this node's configuration asks of its cluster's Kubernetes release, said once at
start (the `cluster_support` log line) and kept for `dra-driver status`
(`<state>/cluster-support.json`), from the table in driver/kube/releases.py.

The publisher learns the server's release and resource.k8s.io version when it first
negotiates; the fallbacks themselves (whole GPUs instead of shares, static MIG, no taints)
stay where they happen, in driver/publish/publisher.py. This only says what they will be.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from driver.kube import releases
from driver.publish.slices import CONSUMABLE
from driver.service.config import Config
from driver.state import atomic

STATE_FILE = "cluster-support.json"


def features_used(config: Config) -> tuple[releases.Feature, ...]:
    """The DRA features this configuration uses. Taints on unhealthy devices and the
    kubelet's health stream are always on; the rest follow their options."""
    used = [releases.DRA, releases.DEVICE_TAINTS, releases.POD_HEALTH]
    if config.gpu_sharing == CONSUMABLE:
        used.append(releases.CONSUMABLE_CAPACITY)
    if config.mig_mode == "dynamic":
        used.append(releases.DYNAMIC_MIG)
    if config.claim_status:
        used.append(releases.CLAIM_STATUS)
    if config.extended_resource_names:
        used.append(releases.EXTENDED_RESOURCES)
    if config.pod_uid:
        used.append(releases.SEAMLESS_UPGRADE)
    return tuple(used)


def report(config: Config, owner: str, server: releases.Release, resource_api: str,
           kubelet: releases.Release | None = None) -> releases.Support:
    """The start-up line (none when all used is on by default there), and the state file
    (always: a file left by a run on an older cluster must not outlive the upgrade).
    `kubelet`: this node's, from its Node (the kubelet's features are judged by it)."""
    found = releases.support(server, resource_api, features_used(config), kubelet)
    log = structlog.get_logger(component="cluster-support")
    if found.line() is not None:
        # A gate off by default may have been turned on: only what the release lacks warns.
        (log.warning if found.missing else log.info)("cluster_support", **found.fields())
    try:
        atomic.write(config.state_dir / STATE_FILE, json.dumps(found.fields()).encode(),
                     owner=owner, durable=False)
    except OSError as err:  # only `status` loses the line
        log.warning("cluster_support_not_recorded", error=str(err))
    return found


def recorded(state_dir: Path) -> dict | None:
    """What the running driver found at its start; None when it has not said."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
