"""Draws the Grafana dashboard's panels from scraped /metrics (hack/utilization-demo.py).

Grafana is not available offline, so this is not a Grafana screenshot: it reads the
dashboard JSON for the panels' titles and grid positions and computes each panel's series
from the scrapes the way its PromQL query does (noted beside each), then draws them with
matplotlib in the same layout.

The PNG carries what it was drawn from in its "Description" text chunk (JSON: the dashboard
file's sha256 and each drawn panel's id and title), so that tests/test_dashboard_picture.py
can tell, without matplotlib, when the dashboard's titles have moved on from the picture.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "dra-accel-driver" / "dashboards" / "dra-accel-driver.json"
IDLE = 60  # the $idle variable for the demo's minutes-long run
GPU_KINDS = ("gpu", "mig")
FIGURE_IN = (16.0, 10.0)
DPI = 100
# Lengths in inches, so that the room for labels does not shrink with a panel's grid size.
CAPTION_IN = 0.35  # a band below the grid: the caption never runs over the bottom panels
GAP_IN = 0.06  # between neighbouring panels, as Grafana's grid leaves
TITLE_IN = 0.34  # above each plot area
# What matplotlib draws outside a plot area: y tick labels and the unit on the left, x tick
# labels and then the legend (below the plot, as Grafana puts it) underneath.
AXIS_LEFT_IN, AXIS_BOTTOM_IN, LEGEND_IN, RIGHT_IN = 0.75, 0.3, 0.3, 0.15
PANEL_BG, TEXT, DIM, LINE = "#181b1f", "#d8d9da", "#8e8e8e", "#2c3235"


@dataclass(frozen=True)
class Cell:
    """A panel's rectangle on the figure, in inches from the bottom left."""

    left: float
    bottom: float
    width: float
    height: float

    def fraction(self, left: float = 0.0, bottom: float = 0.0, right: float = 0.0,
                 top: float = 0.0) -> list[float]:
        """[x, y, w, h] in figure fractions, less the given insets (inches)."""
        width, height = FIGURE_IN
        return [(self.left + left) / width, (self.bottom + bottom) / height,
                (self.width - left - right) / width, (self.height - bottom - top) / height]


def _cell(grid: dict, rows: int) -> Cell:
    column = FIGURE_IN[0] / 24
    row = (FIGURE_IN[1] - CAPTION_IN) / rows
    return Cell(grid["x"] * column + GAP_IN, CAPTION_IN + (rows - grid["y"] - grid["h"]) * row + GAP_IN,
                grid["w"] * column - 2 * GAP_IN, grid["h"] * row - 2 * GAP_IN)


def _rows(scrape: dict, name: str) -> list[tuple[dict, float]]:
    return [(labels, value) for labels, value in scrape.get(f"dra_driver_device_{name}", [])
            if labels.get("kind") in GPU_KINDS]


def _claim(labels: dict) -> str:
    return f"{labels['claim_namespace']}/{labels['claim_name']}"


def _source(dashboard: bytes, drawn: dict[int, str], panels: dict[int, dict]) -> str:
    """The PNG's Description: what the picture was drawn from, for the test that holds it to
    the shipped dashboard."""
    return json.dumps({
        "drawn_by": "hack/hack_dashboard.py",
        "dashboard": str(DASHBOARD.relative_to(DASHBOARD.parents[3])),
        "dashboard_sha256": hashlib.sha256(dashboard).hexdigest(),
        "panels": [{"id": panel_id, "title": panels[panel_id]["title"], "drawn": text}
                   for panel_id, text in sorted(drawn.items())],
    }, sort_keys=True)


def _layout_problems(figure, cells: dict[int, Cell], axes: dict, titles: dict, caption) -> list[str]:
    """What sticks out of its panel: tick labels, units, legends and titles must stay inside
    the panel's rectangle, a title above its plot, the caption inside its band below the grid.
    Checked on every draw because a longer title or another claim's name in a legend moves
    them, and the picture is looked at rarely."""
    renderer = figure.canvas.get_renderer()
    scale = figure.dpi
    problems = []
    slack = 1.0  # pixels: antialiasing of an edge that touches

    def outside(box, left: float, bottom: float, right: float, top: float) -> bool:
        return (box.x0 < left - slack or box.y0 < bottom - slack or box.x1 > right + slack
                or box.y1 > top + slack)

    for panel_id, cell in cells.items():
        bounds = (cell.left * scale, cell.bottom * scale, (cell.left + cell.width) * scale,
                  (cell.bottom + cell.height) * scale)
        if outside(axes[panel_id].get_tightbbox(renderer), *bounds):
            problems.append(f"panel {panel_id}: its axis labels or legend stick out of the panel")
        title = titles[panel_id].get_window_extent(renderer)
        if outside(title, *bounds) or title.y0 < axes[panel_id].get_window_extent(renderer).y1 - slack:
            problems.append(f"panel {panel_id}: its title {titles[panel_id].get_text()!r} does not fit")
    if outside(caption.get_window_extent(renderer), 0, 0, FIGURE_IN[0] * scale, CAPTION_IN * scale):
        problems.append("the caption does not fit below the panels")
    return problems


def draw(history: list[tuple[int, dict]], target: Path) -> None:
    source = DASHBOARD.read_bytes()
    panels = {p["id"]: p for p in json.loads(source)["panels"]}
    seconds = [s for s, _ in history]
    last = history[-1][1]
    allocated = [len({r[0]["device"] for r in _rows(h, "allocated") if r[1] == 1}) for _, h in history]
    idle = [len({r[0]["device"] for r in _rows(h, "idle_seconds") if r[1] > IDLE}) for _, h in history]
    free = len([1 for labels, v in _rows(last, "allocated") if v == 0 and not labels["claim_uid"]])
    busy = [v for labels, v in _rows(last, "kernel_active_ratio") if labels["claim_uid"]]
    figure = plt.figure(figsize=FIGURE_IN, dpi=DPI, facecolor="#111217")
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels.values())
    cells = {panel_id: _cell(p["gridPos"], rows) for panel_id, p in panels.items()}
    drawn: dict[int, str] = {}
    drawn_axes: dict = {}
    titles: dict = {}

    def axes(panel_id: int, *, axis: bool = False, legend: bool = False):
        cell = cells[panel_id]
        # The panel's background is the whole cell, as in Grafana; the plot area sits inside
        # it, leaving room for what is drawn around a plot.
        figure.patches.append(plt.Rectangle((cell.left / FIGURE_IN[0], cell.bottom / FIGURE_IN[1]),
                                            cell.width / FIGURE_IN[0], cell.height / FIGURE_IN[1],
                                            transform=figure.transFigure, facecolor=PANEL_BG,
                                            edgecolor=LINE, linewidth=0.8, zorder=-1))
        inset = 0.1
        ax = figure.add_axes(cell.fraction(left=AXIS_LEFT_IN if axis else inset,
                                           bottom=(AXIS_BOTTOM_IN if axis else inset) + (LEGEND_IN if legend else 0),
                                           right=RIGHT_IN if axis else inset, top=TITLE_IN),
                             facecolor=PANEL_BG)
        drawn[panel_id] = panels[panel_id]["title"].replace("$idle", f"{IDLE}s")
        titles[panel_id] = figure.text((cell.left + 0.1) / FIGURE_IN[0],
                                       (cell.bottom + cell.height - 0.08) / FIGURE_IN[1], drawn[panel_id],
                                       color=TEXT, fontsize=11, fontweight="bold", ha="left", va="top")
        drawn_axes[panel_id] = ax
        ax.tick_params(colors=DIM, labelsize=9, length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        if axis:
            ax.grid(color=LINE, linewidth=0.6)
            ax.set_axisbelow(True)
            ax.xaxis.set_major_formatter(lambda value, _: f"{value:.0f} s")
        else:
            ax.set_xticks([])
            ax.set_yticks([])
        return ax

    def legend_below(ax) -> None:
        # Below the x tick labels, in one row, so that it hides none of the series.
        height = ax.get_position().height * FIGURE_IN[1]
        ax.legend(loc="upper left", bbox_to_anchor=(0, -AXIS_BOTTOM_IN / height), ncol=4, frameon=False,
                  labelcolor=TEXT, fontsize=9, borderaxespad=0, handlelength=1.5, columnspacing=1.5)

    for panel_id, value, color in ((1, str(allocated[-1]), "#73bf69"), (2, str(idle[-1]), "#ff9830"),
                                   (3, str(free), "#5794f2"),
                                   (4, f"{sum(busy) / len(busy) * 100:.0f}%" if busy else "-", "#b877d9")):
        ax = axes(panel_id)
        ax.text(0.5, 0.5, value, color=color, fontsize=40, ha="center", va="center",
                transform=ax.transAxes)
    ax = axes(5, axis=True, legend=True)
    ax.plot(seconds, allocated, color="#73bf69", label="allocated")
    ax.plot(seconds, idle, color="#ff9830", label=f"idle > {IDLE}s")
    ax.set_ylim(0, max(allocated) + 1)
    ax.set_ylabel("devices", color=DIM, fontsize=9)
    legend_below(ax)
    ax = axes(6)
    ax.axis("off")
    top = sorted(((v, labels) for labels, v in _rows(last, "idle_seconds") if v > 0),
                 key=lambda item: -item[0])[:8]
    cells_text = [[labels["claim_namespace"], labels["claim_name"], labels["device"], f"{v:.0f} s"]
                  for v, labels in top] or [["-", "-", "-", "-"]]
    table = ax.table(cellText=cells_text, colLabels=["namespace", "claim", "device", "idle for"],
                     loc="upper center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(10)
    for (row, _), cell in table.get_celld().items():
        cell.set_facecolor(PANEL_BG)
        cell.set_edgecolor(LINE)
        cell.get_text().set_color(DIM if row == 0 else TEXT)
    table.scale(1, 1.5)
    for panel_id, metric, scale, unit in ((7, "kernel_active_ratio", 100, "% kernel time"),
                                          (8, "memory_used_bytes", 1 / (1 << 30), "GiB")):
        ax = axes(panel_id, axis=True, legend=True)
        claims = sorted({_claim(labels) for _, h in history for labels, _ in _rows(h, metric)
                         if labels["claim_uid"]})
        for claim in claims:
            values = [max((v for labels, v in _rows(h, metric) if labels["claim_uid"] and _claim(labels) == claim),
                          default=float("nan")) * scale for _, h in history]
            ax.plot(seconds, values, label=claim)
        if scale == 100:
            ax.set_ylim(0, 100)
        else:
            ax.set_ylim(bottom=0)
        ax.set_ylabel(unit, color=DIM, fontsize=9)
        legend_below(ax)
    # The join on dcgm-exporter's series: the mock run has no dcgm-exporter, so, as in
    # Grafana, the panel is there and empty.
    ax = axes(9)
    ax.text(0.5, 0.5, "no data: needs dcgm-exporter's DCGM_FI_PROF_SM_ACTIVE (joined on UUID, GPU_I_ID)",
            color=DIM, fontsize=11, ha="center", va="center", transform=ax.transAxes)
    # Fragmentation (dra_driver_capacity_*, docs/capacity.md): the mock node's own series;
    # a kind the node does not publish (no MIG, no shareable GPU) has none, as in Grafana.
    for panel_id, metric, kinds, unit, scale in (
            (10, "dra_driver_capacity_free_devices", ("gpu", "gpu-aligned"), "GPUs", 1),
            (11, "dra_driver_capacity_largest_mig_slices", None, "compute slices", 1),
            (12, "dra_driver_capacity_largest_share", None, "GiB", 1 / (1 << 30))):
        def series(scrape: dict, kind) -> float:
            values = [v for labels, v in scrape.get(metric, [])
                      if kind is None or labels.get("kind") == kind
                      if metric != "dra_driver_capacity_largest_share" or labels.get("capacity") == "memory"]
            return max(values, default=float("nan")) * scale

        if not any(metric in h for _, h in history):
            ax = axes(panel_id)
            ax.text(0.5, 0.5, "no data: no " + ("MIG device" if panel_id == 11 else "shareable GPU")
                    + " on this node", color=DIM, fontsize=10, ha="center", va="center", transform=ax.transAxes)
            continue
        ax = axes(panel_id, axis=True, legend=True)
        for kind in kinds or (None,):
            label = {"gpu": "whole GPUs", "gpu-aligned": "on one PCIe root"}.get(kind, unit)
            ax.plot(seconds, [series(h, kind) for _, h in history], label=label)
        ax.set_ylim(bottom=0, top=max([series(h, k) for _, h in history for k in (kinds or (None,))] + [1]) + 1)
        ax.set_ylabel(unit, color=DIM, fontsize=9)
        legend_below(ax)
    undrawn = sorted(set(panels) - set(drawn))
    if undrawn:
        # A panel added to the dashboard needs its series computed here; drawing the others
        # alone would ship a picture that claims to be the dashboard and is not.
        raise SystemExit(f"hack_dashboard: {DASHBOARD.name} has panels {undrawn} that draw() does not draw")
    caption = figure.text(0.1 / FIGURE_IN[0], CAPTION_IN / 2 / FIGURE_IN[1],
                          "Panels of charts/dra-accel-driver/dashboards/dra-accel-driver.json drawn by "
                          "hack/hack_dashboard.py from a mock run's /metrics (hack/utilization-demo.py), "
                          f"$idle = {IDLE} s; not a Grafana screenshot.", color=DIM, fontsize=9, va="center")
    problems = _layout_problems(figure, cells, drawn_axes, titles, caption)
    if problems:
        raise SystemExit("hack_dashboard: " + "; ".join(problems))
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=DPI, facecolor=figure.get_facecolor(),
                   metadata={"Description": _source(source, drawn, panels)})
