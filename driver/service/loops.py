"""What runs while the driver serves, beside the kubelet's calls: the registration held
back during an upgrade until this instance can serve and offered again until the kubelet
takes it, the node's extended resources checked once, shared GPUs reconciled and device
health probed periodically. Each loop outlives its own errors (a
bug is logged, the loop goes on); the plugin (driver/service/plugin.py) starts and cancels them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Awaitable, Callable

import structlog

from driver.kube.client import ApiError, Kube
from driver.kubelet.registration import Registration
from driver.monitoring.health import Prober
from driver.prepare.preparer import Preparer
from driver.publish import extendedresources
from driver.state.instance import Peer

REGISTRATION_BACKOFF_CAP = 300.0


async def reoffer_registration(registration: Registration, offer: Callable[[], Awaitable[None]],
                               first_timeout: float, socket: Path) -> None:
    """Re-offer the registration socket when the kubelet rejected us or never answered;
    the kubelet itself never retries a socket it has seen."""
    log = structlog.get_logger(component="registration")
    timeout = first_timeout
    attempt = 0
    while True:
        waiting = None if registration.registered.is_set() else timeout
        outcome = await registration.outcome(waiting)
        if outcome:
            attempt = 0
            timeout = first_timeout
            continue
        attempt += 1
        if outcome is False:
            delay = min(REGISTRATION_BACKOFF_CAP, 2.0 ** (attempt - 1))
            error = registration.last_error
        else:  # no answer at all: the wait was the delay; wait longer next time
            delay = 0.0
            error = f"no NotifyRegistrationStatus from the kubelet within {timeout:g}s"
            timeout = min(REGISTRATION_BACKOFF_CAP, timeout * 2)
        log.warning("kubelet_registration_retry", attempt=attempt, error=error,
                    retry_in=delay, socket=str(socket))
        await asyncio.sleep(delay)
        await offer()


SERVING_POLL_SECONDS = 0.5


async def register_when_serving(registration: Registration, published: Callable[[], bool],
                                peers: Callable[[], list[Peer]],
                                poll: float = SERVING_POLL_SECONDS) -> None:
    """During an upgrade: return once this instance can serve, its slices published (so
    its API client works: credentials, CA, network), or once no other instance is left.

    The kubelet sends every new call to the newest registration. A new pod that registers
    before it can read a claim takes the node's prepares from the old pod that still can,
    and they fail until someone deletes it; unregistered (and so unready), it stalls the
    rollout instead while the old pod serves."""
    log = structlog.get_logger(component="registration")
    serving = [p.token for p in peers()]
    registration.held = f"instance(s) {', '.join(serving)} serve the node until this one has published"
    log.info("registration_deferred", serving=serving,
             reason="a peer instance serves until this one has published its slices")
    started = time.monotonic()
    try:
        while not published():
            if not peers():
                log.warning("registration_offered_unpublished",
                            reason="no other instance is left to serve the node")
                return
            await asyncio.sleep(poll)
        log.info("registration_released", waited=round(time.monotonic() - started, 2))
    finally:
        registration.held = None


async def check_extended_resources(kube: Kube, node: str, names: tuple[str, ...],
                                   state_dir: Path, token: str) -> None:
    """Once, at start: the extended resource names our DeviceClasses serve that the node
    also advertises (a device plugin still running; driver/publish/extendedresources.py)."""
    log = structlog.get_logger(component="extended-resources")
    while True:
        try:
            obj = await asyncio.to_thread(kube.request, "GET", f"/api/v1/nodes/{node}")
            break
        except ApiError as err:  # the API server is down: look again later
            log.warning("node_lookup_failed", node=node, error=str(err))
            await asyncio.sleep(30)
    found = extendedresources.served_twice(obj or {}, names)
    for twice in found:
        log.warning("extended_resource_served_twice", node=node, resource=twice.name,
                    allocatable=twice.allocatable, message=twice.message(node))
    try:
        extendedresources.record(state_dir, token, found)
    except OSError as err:
        log.warning("extended_resources_not_recorded", error=str(err))


async def reconcile_sharing(preparer: Preparer, interval: float) -> None:
    """Shared GPUs as the prepared claims need them: after a crash or reboot at once,
    then periodically (a dead MPS daemon, a setup whose undo failed)."""
    log = structlog.get_logger(component="sharing")
    while True:
        try:
            await preparer.reconcile_sharing()
        except Exception as err:  # a bug must not end the loop
            log.exception("sharing_reconcile_failed", error=str(err))
        await asyncio.sleep(interval)


async def probe(prober: Prober, interval: float) -> None:
    """Device health every `interval` seconds; the prober's held files close with it."""
    log = structlog.get_logger(component="health")
    try:
        while True:
            try:
                await asyncio.to_thread(prober.probe)
            except Exception as err:  # a probe bug must not end health reporting
                log.error("health_probe_failed", error=str(err))
            await asyncio.sleep(interval)
    finally:
        prober.close()
