"""Turns the recorder's output (extract.sh) into tests/data/upstream_allocator_scenarios.json:
one entry per upstream scenario whose upstream assertions passed, sorted by name."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PREFIX = "TestRecordScenarios/"


def main(events_path: str, out_dir: str, version: str) -> None:
    files: dict[str, str] = {}
    outcome: dict[str, str] = {}
    for line in Path(events_path).read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        test = event.get("Test") or ""
        if not test.startswith(PREFIX) or "/" in test[len(PREFIX):]:
            continue
        name = test[len(PREFIX):]
        m = re.search(r'RECORDED.*file="?(\d+\.json)', event.get("Output") or "")
        if m:
            files[name] = m.group(1)
        if event.get("Action") in ("pass", "fail", "skip"):
            outcome[name] = event["Action"]
    scenarios = []
    for name in sorted(outcome):
        if outcome[name] != "pass" or name not in files:
            continue
        rec = json.loads((Path(out_dir) / files[name]).read_text())
        scenarios.append({"name": name, **rec})
    counts = {k: sum(1 for v in outcome.values() if v == k) for k in ("pass", "fail", "skip")}
    json.dump({"source": f"k8s.io/dynamic-resource-allocation {version}, structured/internal/"
                         "allocatortesting (TestAllocator, TestLexicographicalAllocator), run on "
                         "the experimental allocator: inputs and the answer upstream's assertions "
                         "accepted (hack/allocator-oracle/upstream/extract.sh)",
               "upstream_outcomes": counts, "scenarios": scenarios}, sys.stdout, indent=None,
              separators=(",", ":"), sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
