"""One node's burst against the real kube-apiserver (issue 42, item 5): 64 one-claim
NodePrepareResources calls at once, as the kubelet sends them for 64 pods that start
together, beside the API-only floor of the same burst (bench/floor.py's BurstFloor: the
same claim GETs and status applies, with the driver's credentials, 64 clients at once,
no driver), in rounds that alternate the two in one run (`python3 -m bench.realapi`).

Two figures for the driver: until every prepare was answered (what the kubelet waits
for; the pods start then) and until every claim's status apply was answered (all of its
API work, which is what the floor does). Both times come from the same clock: the
bench's wall clock for the start and the answers, and the API server's audit log (same
machine) for when each GET and each apply arrived and was answered, for the driver and
the floor alike. That log also splits each claim's time into steps, which says where
the driver's time goes.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.floor import BurstClaim, BurstFloor
from bench.harness import DRIVER, settle
from bench.table import Table, pct

CLAIMS = 64


@dataclass
class Round:
    seconds: float
    latencies: list[float]  # each claim's, from the burst's start

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds


@dataclass
class BurstFigures:
    answered: list[Round] = field(default_factory=list)  # the driver, to the prepare answers
    applied: list[Round] = field(default_factory=list)  # the driver, to the status applies answered
    floor: list[Round] = field(default_factory=list)  # the floor, to the status applies answered
    # per claim, seconds: where each claim's time went (medians are printed)
    steps: dict[str, list[float]] = field(default_factory=dict)
    floor_steps: dict[str, list[float]] = field(default_factory=dict)
    # per round, CPU seconds of each process in the burst's window
    cpu: dict[str, list[float]] = field(default_factory=dict)
    floor_cpu: dict[str, list[float]] = field(default_factory=dict)
    # per round, seconds the bench's kubelet took to send its calls (gRPC futures from one
    # Python thread; the kubelet's goroutines send theirs at once): part of "start -> GET"
    issued: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Request:
    received: float  # wall clock, the API server's
    answered: float


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Audit:
    """The API server's audit log from an offset on: when each claim's GET and status
    apply arrived and were answered (hack/local-cluster logs the driver's ServiceAccount's
    requests at Metadata level, at ResponseComplete)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def requests(self, names: set[str]) -> tuple[dict[str, Request], dict[str, Request]]:
        """({claim: its GET}, {claim: its last status apply}) of the claims named."""
        gets: dict[str, Request] = {}
        applies: dict[str, Request] = {}
        self.refused: list[str] = []
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            for line in log.read().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written
                ref = event.get("objectRef") or {}
                if ref.get("resource") != "resourceclaims" or ref.get("name") not in names:
                    continue
                if (event.get("responseStatus") or {}).get("code") != 200:
                    # a refused write is not the claim's status written: seen when the
                    # claims had no node selector (422 from the node authorizer)
                    self.refused.append(f"{event.get('verb')} {ref['name']}: "
                                        f"{(event.get('responseStatus') or {}).get('code')}")
                    continue
                request = Request(_stamp(event["requestReceivedTimestamp"]), _stamp(event["stageTimestamp"]))
                if event.get("verb") == "get" and not ref.get("subresource"):
                    gets.setdefault(ref["name"], request)
                elif event.get("verb") == "patch" and ref.get("subresource") == "status":
                    applies[ref["name"]] = request
        return gets, applies

    def wait(self, names: set[str], timeout: float = 60) -> tuple[dict[str, Request], dict[str, Request]]:
        deadline = time.monotonic() + timeout
        while True:
            gets, applies = self.requests(names)
            if len(applies) == len(names) and len(gets) == len(names):
                return gets, applies
            if time.monotonic() > deadline:
                raise RuntimeError(f"the audit log has {len(gets)} GETs and {len(applies)} status "
                                   f"applies of {len(names)} claims after {timeout:g} s; refused: "
                                   f"{len(self.refused)}, the first {self.refused[:1]}")
            time.sleep(0.05)


class Cpu:
    """CPU seconds of some processes (by pid; "bench": this one) over a window."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        seconds = {}
        for name, pid in self.pids.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                seconds[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                seconds[name] = float("nan")
        return seconds

    def into(self, record: dict[str, list[float]]) -> None:
        now = self._now()
        for name in self.pids:
            record.setdefault(name, []).append(now[name] - self.start[name])


def _note(steps: dict[str, list[float]], name: str, seconds: float) -> None:
    steps.setdefault(name, []).append(seconds)


def driver_round(api, kubelet, make_claim, audit_log: Path, pids: dict[str, int],
                 figures: BurstFigures, size: int = CLAIMS) -> list[dict]:
    """One burst of `size` one-claim prepares; returns one claim's status.devices as the
    driver applied them (the floor applies the same)."""
    claims = [make_claim() for _ in range(size)]
    settle(api)
    audit = Audit(audit_log)
    answered: dict[str, float] = {}
    cpu = Cpu(pids)
    start = time.time()
    calls = [kubelet.future("NodePrepareResources", [c], timeout=120) for c in claims]
    figures.issued.append(time.time() - start)
    for claim, call in zip(claims, calls):
        # the answer's time, taken on gRPC's thread as it arrives
        call.add_done_callback(lambda _, name=claim.name: answered.setdefault(name, time.time()))
    responses = [call.result() for call in calls]
    last_answer = time.time()
    failed = [r.claims[c.uid].error for c, r in zip(claims, responses) if r.claims[c.uid].error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {size} prepares failed, the first: {failed[0]}")
    names = {c.name for c in claims}
    gets, applies = audit.wait(names)
    cpu.into(figures.cpu)
    figures.answered.append(Round(max(last_answer, *answered.values()) - start,
                                  [answered[c.name] - start for c in claims]))
    figures.applied.append(Round(max(a.answered for a in applies.values()) - start,
                                 [applies[c.name].answered - start for c in claims]))
    for c in claims:
        get, apply, answer = gets[c.name], applies[c.name], answered[c.name]
        _note(figures.steps, "start -> GET arrives", get.received - start)
        _note(figures.steps, "GET in the API server", get.answered - get.received)
        _note(figures.steps, "GET answered -> prepare answered", answer - get.answered)
        _note(figures.steps, "prepare answered -> apply arrives", apply.received - answer)
        _note(figures.steps, "apply in the API server", apply.answered - apply.received)
    code, claim = api.cluster.api("GET", f"/apis/resource.k8s.io/v1/namespaces/{claims[0].namespace}"
                                         f"/resourceclaims/{claims[0].name}")
    entries = [d for d in (claim.get("status") or {}).get("devices") or [] if d.get("driver") == DRIVER]
    kubelet.unprepare(claims, timeout=120)
    if code != 200 or not entries:
        raise RuntimeError(f"claim {claims[0].name}: no status.devices of {DRIVER} after its prepare "
                           f"({code})")
    return entries


def floor_round(api, floor: BurstFloor, make_claim, entries: list[dict], audit_log: Path,
                pids: dict[str, int], figures: BurstFigures, size: int = CLAIMS) -> None:
    claims = [make_claim() for _ in range(size)]
    settle(api)
    audit = Audit(audit_log)
    cpu = Cpu(pids)
    start = time.time()
    floor.burst([BurstClaim(c.namespace, c.name, c.uid) for c in claims], entries)
    gets, applies = audit.wait({c.name for c in claims})
    cpu.into(figures.floor_cpu)
    figures.floor.append(Round(max(a.answered for a in applies.values()) - start,
                               [applies[c.name].answered - start for c in claims]))
    for c in claims:
        get, apply = gets[c.name], applies[c.name]
        _note(figures.floor_steps, "start -> GET arrives", get.received - start)
        _note(figures.floor_steps, "GET in the API server", get.answered - get.received)
        _note(figures.floor_steps, "GET answered -> apply arrives", apply.received - get.answered)
        _note(figures.floor_steps, "apply in the API server", apply.answered - apply.received)


def measure(api, driver, kubelet, make_claim, kubeconfig: Path, audit_log: Path,
            server_pids: dict[str, int], rounds: int, size: int = CLAIMS) -> BurstFigures:
    """`rounds` bursts of `size` claims of the driver and of the floor, alternating (driver
    first: the floor applies what the driver's first burst applied), after one of each
    that warms connections and caches."""
    figures = BurstFigures()
    pids = {"driver": driver.proc.pid, **server_pids, "bench": os.getpid()}
    floor = BurstFloor(kubeconfig, size)
    try:
        entries = driver_round(api, kubelet, make_claim, audit_log, pids, BurstFigures(), size)
        floor_round(api, floor, make_claim, entries, audit_log, pids, BurstFigures(), size)
        for _ in range(rounds):
            driver_round(api, kubelet, make_claim, audit_log, pids, figures, size)
            floor_round(api, floor, make_claim, entries, audit_log, pids, figures, size)
    finally:
        floor.close()
    return figures


def _rates(rounds: list[Round]) -> float:
    return statistics.median(r.rate for r in rounds)


def _latencies(rounds: list[Round]) -> list[float]:
    return [x for r in rounds for x in r.latencies]


def rows(table: Table, label: str, f: BurstFigures) -> None:
    n = len(f.floor)
    floor_rate = _rates(f.floor)
    spread = lambda rs: f"rounds {min(r.rate for r in rs):.0f}-{max(r.rate for r in rs):.0f}"  # noqa: E731
    table.latency(f"burst of {CLAIMS}: API floor, GET + status apply ({label})", _latencies(f.floor),
                  f"{floor_rate:.0f} claims/s ({spread(f.floor)}, {n} rounds)")
    table.latency(f"burst of {CLAIMS}: driver, prepares answered ({label})", _latencies(f.answered),
                  f"{_rates(f.answered):.0f} claims/s ({spread(f.answered)})")
    table.latency(f"burst of {CLAIMS}: driver, status applied ({label})", _latencies(f.applied),
                  f"{_rates(f.applied):.0f} claims/s ({spread(f.applied)})")
    table.value(f"burst: driver / floor, prepares answered ({label})",
                f"{_rates(f.answered) / floor_rate:.2f}x", f"paired by round: {_paired(f.answered, f.floor)}")
    table.value(f"burst: driver / floor, status applied ({label})",
                f"{_rates(f.applied) / floor_rate:.2f}x", f"paired by round: {_paired(f.applied, f.floor)}")


def _paired(driver: list[Round], floor: list[Round]) -> str:
    """The median and range of each driver round's rate over the floor round right after
    it: on shared cores a slow minute slows both of a pair, so the pairs scatter less
    than the two medians' ratio does."""
    ratios = sorted(d.rate / f.rate for d, f in zip(driver, floor))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def where(f: BurstFigures) -> None:
    """Each step's median and p99 per claim, and the CPU each process spent in a round."""
    print(f"where a claim's time goes in a burst of {CLAIMS} (per claim, median / p99, ms):")
    for title, steps in (("driver", f.steps), ("floor", f.floor_steps)):
        for name, values in steps.items():
            print(f"  {title:6} {name:36} {statistics.median(values) * 1000:8.1f} "
                  f"{pct(values, 0.99) * 1000:8.1f}")
    print(f"  the bench's kubelet sent its {CLAIMS} calls in {statistics.median(f.issued) * 1000:.1f} ms "
          f"(median of the rounds; part of the driver's start -> GET)")
    print("CPU seconds in a round (median), driver round / floor round:")
    for name in f.cpu:
        print(f"  {name:16} {statistics.median(f.cpu[name]):6.3f} / {statistics.median(f.floor_cpu[name]):6.3f}")
