"""The figures a run prints: medians and p99s of latencies, values with a note, and the
table they end in."""

from __future__ import annotations

import statistics


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def latency(self, name: str, seconds: list[float], note: str = "") -> float:
        median = statistics.median(seconds)
        self.rows.append((name, f"{median * 1000:.3f} ms", f"{pct(seconds, 0.99) * 1000:.3f} ms", note))
        return median

    def value(self, name: str, value: str, note: str = "") -> None:
        self.rows.append((name, value, "", note))

    def print(self) -> None:
        widths = [max(len(r[i]) for r in self.rows + [("figure", "median", "p99", "note")]) for i in range(4)]
        header = ("figure", "median", "p99", "note")
        for row in [header] + self.rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())

def pq_ratio(with_status: float, without: list[float]) -> str:
    return f"with status writes: {with_status / statistics.median(without):.2f}x"
