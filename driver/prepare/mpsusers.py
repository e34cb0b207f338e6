"""Who would talk to a GPU's MPS control daemon: the users and containers of a claim's pods.

Two facts about MPS make the pods matter, not only the claims:

* A control daemon runs one MPS server per Linux user. A client of another UID than the
  running server's is queued until every client of that server has exited, so a share
  whose pod runs as UID 2000 beside shares running as UID 1000 would hang in CUDA
  initialization for as long as those run. Prepare refuses it instead, naming both claims.
  Only a UID the pod spec states (`runAsUser` of the container or the pod) is known here;
  a container without one runs as its image's user, which the driver cannot see.
* A container reaches one control daemon (CUDA_MPS_PIPE_DIRECTORY is one folder). A
  container that references two claims whose MPS daemons are on two GPUs cannot use both;
  prepare says so instead of letting the second pipe folder's mount silently win.

The pods come from the claim's `status.reservedFor` (the kubelet prepares a claim for a
pod that is reserved in it); they are read only for claims that use MPS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping


@dataclass(frozen=True)
class MpsUsers:
    """The pods of one claim, as far as MPS cares."""

    run_as: tuple[int, ...] = ()  # the UIDs their containers run as, where the spec says
    unknown_user: tuple[str, ...] = ()  # "pod/container" running as the image's user
    # "pod/container" -> the names of the ResourceClaim objects it references
    containers: Mapping[str, tuple[str, ...]] | None = None

    @classmethod
    def of_pods(cls, pods: Iterable[dict]) -> "MpsUsers":
        run_as: set[int] = set()
        unknown: list[str] = []
        containers: dict[str, tuple[str, ...]] = {}
        for pod in pods:
            meta = pod.get("metadata") or {}
            spec = pod.get("spec") or {}
            default_uid = (spec.get("securityContext") or {}).get("runAsUser")
            claims = _claim_names(pod)
            for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
                where = f"{meta.get('name', '?')}/{container.get('name', '?')}"
                uid = (container.get("securityContext") or {}).get("runAsUser", default_uid)
                if isinstance(uid, int) and not isinstance(uid, bool):
                    run_as.add(uid)
                else:
                    unknown.append(where)
                referenced = tuple(sorted(claims[r["name"]] for r in
                                          ((container.get("resources") or {}).get("claims") or [])
                                          if isinstance(r, dict) and r.get("name") in claims))
                if referenced:
                    containers[where] = referenced
        return cls(tuple(sorted(run_as)), tuple(unknown), containers)


def _claim_names(pod: dict) -> dict[str, str]:
    """The pod's claim entry names -> ResourceClaim object names (a template's claim is
    named in the pod's status, once the resourceclaim controller made it)."""
    names: dict[str, str] = {}
    generated = {s.get("name"): s.get("resourceClaimName")
                 for s in ((pod.get("status") or {}).get("resourceClaimStatuses") or [])
                 if isinstance(s, dict)}
    for entry in ((pod.get("spec") or {}).get("resourceClaims") or []):
        if not isinstance(entry, dict) or not entry.get("name"):
            continue
        claim = entry.get("resourceClaimName") or generated.get(entry["name"])
        if claim:
            names[entry["name"]] = claim
    return names


def uid_conflict(claim: str, mine: tuple[int, ...], device: str,
                 others: Iterable[tuple[str, tuple[int, ...]]]) -> str | None:
    """Why `claim`'s MPS use of `device` cannot join the claims already there, or None."""
    if len(mine) > 1:
        return (f"claim {claim}: its pods run as UIDs {', '.join(map(str, mine))} on the MPS-shared "
                f"{device}; an MPS control daemon serves one UID at a time (a second UID's "
                "clients wait until all of the first's have exited): run them as one user")
    for other, theirs in others:
        if mine and theirs and set(mine) != set(theirs):
            return (f"claim {claim}: its pods run as UID {mine[0]}, but claim {other} on the "
                    f"MPS-shared {device} runs as UID {', '.join(map(str, theirs))}; an MPS "
                    "control daemon serves one UID at a time (a second UID's clients wait until "
                    "all of the first's have exited), so shares of one GPU must run as the same "
                    "user (runAsUser)")
    return None
