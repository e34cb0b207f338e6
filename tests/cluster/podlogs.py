"""Every log line of the driver's pods while a test runs, kept after the pods are gone.

`kubectl logs` reads a pod's current (or one previous) container only, and nothing once
the pod is deleted: an upgrade deletes the old pod, and a test that asks afterwards what
the old pod prepared gets nothing. So a thread copies the kubelet's container log files
(`/var/log/pods/<ns>_<pod>_<uid>/<container>/<restart>.log`, CRI format) as they grow,
for every pod and restart of the namespace, until it is stopped.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# The kubelet's podLogsDir (default; hack/local-cluster does not move it).
POD_LOGS = Path("/var/log/pods")


@dataclass
class ContainerLog:
    pod: str
    pod_uid: str
    restart: int
    text: list[str] = field(default_factory=list)
    offset: int = 0
    partial: str = ""


@dataclass
class PodLogs:
    """Follows the `container` logs of the pods of `namespace` (started by `start()`)."""

    namespace: str
    container: str = "plugin"
    interval: float = 0.3
    root: Path = POD_LOGS
    _logs: dict[Path, ContainerLog] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def start(self) -> "PodLogs":
        self.poll()
        self._thread = threading.Thread(target=self._run, name="pod-logs", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for path in self.root.glob(f"{self.namespace}_*/{self.container}/*.log"):
            with self._lock:
                log = self._logs.get(path)
                if log is None:
                    _, pod, uid = path.parent.parent.name.split("_", 2)
                    log = self._logs[path] = ContainerLog(pod, uid, int(path.stem))
                try:
                    with open(path, "rb") as f:
                        f.seek(log.offset)
                        data = f.read()
                except FileNotFoundError:
                    continue
                # a file rotated (truncated) would start again at 0: not at these sizes
                log.offset += len(data)
                for raw in data.decode(errors="replace").splitlines():
                    # "<time> <stream> <P|F> <text>": P is a part of a longer line
                    parts = raw.split(" ", 3)
                    if len(parts) < 4:
                        continue
                    log.partial += parts[3]
                    if parts[2] == "F":
                        log.text.append(log.partial)
                        log.partial = ""

    def events(self, pod: str | None = None) -> list[tuple[str, dict]]:
        """(pod name, decoded JSON line) of every line so far, of one pod or all."""
        self.poll()
        out = []
        with self._lock:
            logs = sorted(self._logs.values(), key=lambda c: (c.pod, c.restart))
            for log in logs:
                if pod is not None and log.pod != pod:
                    continue
                for line in log.text:
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(ev, dict):
                        out.append((log.pod, ev))
        return out

    def pods(self) -> set[str]:
        with self._lock:
            return {c.pod for c in self._logs.values()}

    def claim_events(self, kinds: set[str], claim_uids: set[str] | None = None) -> Counter:
        """How often each claim UID was logged with one of these events, all pods together."""
        counts: Counter = Counter()
        for _, ev in self.events():
            if ev.get("event") in kinds and (claim_uids is None or ev.get("claim_uid") in claim_uids):
                counts[ev.get("claim_uid")] += 1
        return counts

    def who(self, event: str, claim_uid: str) -> list[str]:
        """The pods that logged `event` for this claim."""
        return [pod for pod, ev in self.events() if ev.get("event") == event and ev.get("claim_uid") == claim_uid]

    def text(self, pod: str | None = None, last: int = 40) -> str:
        self.poll()
        with self._lock:
            lines = [f"{c.pod}#{c.restart}: {t}" for c in sorted(self._logs.values(), key=lambda c: (c.pod, c.restart))
                     if pod is None or c.pod == pod for t in c.text]
        return "\n".join(lines[-last:])
