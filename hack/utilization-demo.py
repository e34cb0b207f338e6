"""A mock node with busy and idle claims, for the README's `dra-driver status` output and
the dashboard picture in docs/utilization.md.

Runs the real driver (`dra-driver run --mock h100x8`) against the API server emulator and
a fake kubelet, prepares four claims, scripts what their GPUs do through the mock's
gpu-load/ files, and prints `dra-driver status` once the idle claims have been reported.
With `--png FILE` (needs matplotlib) it also scrapes /metrics every second for
`--minutes` of simulated load and draws the dashboard's panels from the scraped series,
laid out as charts/dra-accel-driver/dashboards/dra-accel-driver.json lays them out.

    python hack/utilization-demo.py [--png docs/images/utilization-dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from driver.devices.mock.gpuload import GpuLoadStore  # noqa: E402
from driver.sim.apiserver import ApiServer, claim_allocated  # noqa: E402
from driver.sim.kubelet import Claim, FakeKubelet  # noqa: E402

DRIVER, NODE = "accel.dra.io", "gpu-node-7"
GIB = 1 << 30
# (namespace, claim, device, SM %, memory used)
CLAIMS = (
    ("team-a", "train-llm", "gpu-0000-11-00-0", 92, 71 * GIB),
    ("team-a", "notebook-anna", "gpu-0000-21-00-0", 0, 312 << 20),
    ("team-b", "infer-ranker", "gpu-0000-31-00-0", 35, 18 * GIB),
    ("team-b", "forgotten-job", "gpu-0000-41-00-0", 0, 22 * GIB),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((dict(s.labels), s.value))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--minutes", type=int, default=3, help="seconds of scraping for the picture, x60")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="dra-util-demo-"))
    metrics_port = free_port()
    with ApiServer() as api:
        api.add_node(NODE)
        state = base / "state"
        command = [sys.executable, "-m", "driver", "run", "--node-name", NODE, "--driver-name", DRIVER,
                   "--mock", "h100x8", "--kubeconfig", str(api.kubeconfig(base)),
                   "--kubelet-registrar-dir", str(base / "registry"),
                   "--kubelet-plugins-dir", str(base / "plugins"), "--cdi-root", str(base / "cdi"),
                   "--state-dir", str(state), "--metrics-port", str(metrics_port), "--healthz-port", "0",
                   "--utilization-interval", "1", "--idle-after", "5", "--log-level", "warning"]
        driver = subprocess.Popen(command, stderr=open(base / "driver.log", "wb"))
        try:
            kubelet = FakeKubelet(base / "registry")
            kubelet.register(timeout=60)
            loads = GpuLoadStore(state / "mock")
            claims = []
            for namespace, name, device, sm, memory in CLAIMS:
                uid = str(uuid.uuid4())
                claim = claim_allocated(namespace, name, uid, [
                    {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}])
                claim["status"]["reservedFor"] = [{"resource": "pods", "name": f"{name}-0",
                                                   "uid": str(uuid.uuid4())}]
                api.put_claim(claim)
                claims.append(Claim(namespace, name, uid))
            inventory = json.loads(subprocess.run(
                [sys.executable, "-m", "driver", "discover", "--mock", "h100x8", "-o", "json"],
                capture_output=True, text=True, check=True).stdout)
            uuids = {d["name"]: d["attributes"]["uuid"]["string"] for s in inventory["items"]
                     for d in s["spec"]["devices"] if "uuid" in d["attributes"]}
            for (_, _, device, sm, memory), pid in zip(CLAIMS, range(4101, 4200)):
                loads.set(uuids[device], sm_percent=sm, processes=[(pid, memory)])
            kubelet.prepare(claims)
            deadline = time.monotonic() + 30
            while len(api.state.events) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(20)  # NVML's sample buffer (what `status` averages) holds the new load
            shown = subprocess.run([sys.executable, "-m", "driver", "status", "--mock", "h100x8",
                                    "--node-name", NODE, "--state-dir", str(state)],
                                   capture_output=True, text=True, check=True)
            print("$ dra-driver status")
            print(shown.stdout, end="")
            for event in api.state.events:
                print(f"event on {event['regarding']['namespace']}/{event['regarding']['name']}: "
                      f"{event['reason']}: {event['note']}")
            if args.png:
                history = []
                for second in range(args.minutes * 60):
                    # The notebook's owner comes back for a minute; the ranker's traffic ebbs.
                    if second == 60:
                        loads.set(uuids[CLAIMS[1][2]], sm_percent=55)
                    if second == 120:
                        loads.set(uuids[CLAIMS[1][2]], sm_percent=0)
                    if second % 20 == 0:
                        loads.set(uuids[CLAIMS[2][2]], sm_percent=20 + (second * 7) % 40)
                    history.append((second, scrape(metrics_port)))
                    time.sleep(1.0)
                from hack_dashboard import draw  # noqa: PLC0415 - matplotlib only here

                draw(history, args.png)
                print(f"wrote {args.png}")
            kubelet.unprepare(claims)
            kubelet.close()
        finally:
            driver.terminate()
            driver.wait(20)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())
