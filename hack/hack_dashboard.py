"""Draws the Grafana dashboard's panels from scraped /metrics (hack/utilization-demo.py).

Grafana is not available offline, so this is not a Grafana screenshot: it reads the
dashboard JSON for the panels' titles and grid positions and computes each panel's series
from the scrapes the way its PromQL query does (noted beside each), then draws them with
matplotlib in the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "dra-accel-driver" / "dashboards" / "dra-accel-driver.json"
IDLE = 60  # the $idle variable for the demo's minutes-long run
GPU_KINDS = ("gpu", "mig")


def _rows(scrape: dict, name: str) -> list[tuple[dict, float]]:
    return [(labels, value) for labels, value in scrape.get(f"dra_driver_device_{name}", [])
            if labels.get("kind") in GPU_KINDS]


def _claim(labels: dict) -> str:
    return f"{labels['claim_namespace']}/{labels['claim_name']}"


def draw(history: list[tuple[int, dict]], target: Path) -> None:
    panels = {p["id"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    seconds = [s for s, _ in history]
    last = history[-1][1]
    allocated = [len({r[0]["device"] for r in _rows(h, "allocated") if r[1] == 1}) for _, h in history]
    idle = [len({r[0]["device"] for r in _rows(h, "idle_seconds") if r[1] > IDLE}) for _, h in history]
    free = len([1 for labels, v in _rows(last, "allocated") if v == 0 and not labels["claim_uid"]])
    busy = [v for labels, v in _rows(last, "kernel_active_ratio") if labels["claim_uid"]]
    figure = plt.figure(figsize=(16, 10), facecolor="#111217")
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels.values())

    def axes(panel_id: int):
        grid = panels[panel_id]["gridPos"]
        ax = figure.add_axes([grid["x"] / 24 + 0.008, 1 - (grid["y"] + grid["h"]) / rows + 0.02,
                              grid["w"] / 24 - 0.016, grid["h"] / rows - 0.05], facecolor="#181b1f")
        ax.set_title(panels[panel_id]["title"].replace("$idle", f"{IDLE}s"), color="#d8d9da",
                     loc="left", fontsize=10)
        ax.tick_params(colors="#8e8e8e", labelsize=8)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        return ax

    for panel_id, value, color in ((1, str(allocated[-1]), "#73bf69"), (2, str(idle[-1]), "#ff9830"),
                                   (3, str(free), "#5794f2"),
                                   (4, f"{sum(busy) / len(busy) * 100:.0f}%" if busy else "-", "#b877d9")):
        ax = axes(panel_id)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.45, value, color=color, fontsize=34, ha="center", va="center",
                transform=ax.transAxes)
    ax = axes(5)
    ax.plot(seconds, allocated, color="#73bf69", label="allocated")
    ax.plot(seconds, idle, color="#ff9830", label=f"idle > {IDLE}s")
    ax.set_ylim(0, max(allocated) + 1)
    ax.legend(facecolor="#181b1f", labelcolor="#d8d9da", fontsize=8)
    ax = axes(6)
    ax.axis("off")
    top = sorted(((v, labels) for labels, v in _rows(last, "idle_seconds") if v > 0),
                 key=lambda item: -item[0])[:8]
    cells = [[labels["claim_namespace"], labels["claim_name"], labels["device"], f"{v:.0f} s"]
             for v, labels in top] or [["-", "-", "-", "-"]]
    table = ax.table(cellText=cells, colLabels=["namespace", "claim", "device", "idle for"],
                     loc="upper center", cellLoc="left")
    for cell in table.get_celld().values():
        cell.set_facecolor("#181b1f")
        cell.set_edgecolor("#2c3235")
        cell.get_text().set_color("#d8d9da")
    table.scale(1, 1.4)
    for panel_id, metric, scale in ((7, "kernel_active_ratio", 100), (8, "memory_used_bytes", 1 / (1 << 30))):
        ax = axes(panel_id)
        claims = sorted({_claim(labels) for _, h in history for labels, _ in _rows(h, metric)
                         if labels["claim_uid"]})
        for claim in claims:
            values = [max((v for labels, v in _rows(h, metric) if labels["claim_uid"] and _claim(labels) == claim),
                          default=float("nan")) * scale for _, h in history]
            ax.plot(seconds, values, label=claim)
        ax.set_ylabel("% kernel time" if scale == 100 else "GiB", color="#8e8e8e", fontsize=8)
        ax.legend(facecolor="#181b1f", labelcolor="#d8d9da", fontsize=7, loc="upper right")
    # The join on dcgm-exporter's series: the mock run has no dcgm-exporter, so, as in
    # Grafana, the panel is there and empty.
    ax = axes(9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, "no data: needs dcgm-exporter's DCGM_FI_PROF_SM_ACTIVE (joined on UUID, GPU_I_ID)",
            color="#8e8e8e", fontsize=10, ha="center", va="center", transform=ax.transAxes)
    figure.text(0.01, 0.005, "Panels of charts/dra-accel-driver/dashboards/dra-accel-driver.json drawn by "
                "hack/hack_dashboard.py from a mock run's /metrics (hack/utilization-demo.py), $idle = 60 s; "
                "not a Grafana screenshot.", color="#8e8e8e", fontsize=8)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=80, facecolor=figure.get_facecolor())
