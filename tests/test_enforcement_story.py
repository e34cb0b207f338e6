"""One story about what sharing a GPU enforces (issue 40, item 4).

docs/sharing.md holds one table, "What is enforced, per mode"; every other page links to
it. The examples' index called each consumable share "enforced (MPS)" and the chart's
values said "the driver enforces each share", while the sharing guide (and MPS itself:
the client limits are per-process environment settings) says they are accounted, not
enforced. These tests read the pages users read and fail where one of them says again
that a share's own limits, time-slicing or a split between pods is enforced.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import REPO

SHARING = REPO / "docs" / "sharing.md"
TABLE_HEADING = "What is enforced, per mode"


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def enforcement_table() -> dict[str, dict[str, str]]:
    """The rows of the table under TABLE_HEADING, by mode, each a dict column -> cell."""
    text = SHARING.read_text()
    section = text.split(f"## {TABLE_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    table = {}
    for row in rows[2:]:  # after the header and its |---| line
        cells = [c.strip() for c in row.strip("|").split("|")]
        table[cells[0]] = dict(zip(header, cells))
    return table


def user_pages() -> list[Path]:
    """What users read about sharing: the READMEs, docs, examples, the chart's values and
    notes, and the driver's own comments (a comment is where the next doc is copied from)."""
    chart = REPO / "charts" / "dra-accel-driver"
    pages = [REPO / "README.md", chart / "README.md", chart / "values.yaml", chart / "templates" / "NOTES.txt"]
    pages += sorted((REPO / "docs").glob("**/*.md"))
    pages += sorted((REPO / "examples").glob("**/*.md")) + sorted((REPO / "examples").glob("**/*.yaml"))
    pages += sorted((REPO / "driver").glob("**/*.py"))
    return pages


def clauses(text: str) -> list[str]:
    """Table cells, sentences and clauses (split at ';' and ':' too), comment markers gone."""
    units = []
    for block in re.split(r"\n\s*\n", text):
        lines = [re.sub(r"^\s*#+\s?", "", line) for line in block.splitlines()]
        prose = []
        for line in lines:
            if line.lstrip().startswith("|"):
                units += line.strip().strip("|").split("|")
            else:
                prose.append(line.strip())
        units.append(" ".join(prose))
    return [c.strip() for u in units for c in re.split(r"(?<=[.;:!?])\s+", u) if c.strip()]


NEGATED = re.compile(r"\b(not|never|nothing|rather than|nor)\s+(\w+\s+)?$", re.I)
# What the table says is not enforced: a share's own limits, time-slicing, a split between pods.
NOT_ENFORCED_SUBJECT = re.compile(r"\bshares?\b|time-?slic|\b(per|each|every) pod\b", re.I)
# ... and what about shares is enforced: that they add up to at most the GPU.
THE_SUM = re.compile(r"\bsum\b|add up|arithmetic|overcommit", re.I)


def sharing_headings() -> list[str]:
    """The guide's headings about enforcement: a page that names one (to link to it) says
    nothing itself."""
    return [h for h in re.findall(r"^#+ (.+)$", SHARING.read_text(), re.M) if "enforc" in h.lower()]


def claims_enforcement(clause: str) -> bool:
    """Whether the clause says something is enforced (an 'enforc…' not negated right before,
    and not 'enforces nothing')."""
    for heading in sharing_headings():
        clause = re.sub(re.escape(heading), "", clause, flags=re.I)
    for match in re.finditer(r"enforc\w*", clause, re.I):
        before, after = clause[:match.start()], clause[match.end():]
        if not NEGATED.search(before) and not re.match(r"\s+nothing\b", after, re.I):
            return True
    return False


def test_the_table_has_a_row_for_every_mode_the_driver_offers():
    from driver.prepare.opaque import MPS, TIME_SLICING

    table = enforcement_table()
    schema = json.loads((REPO / "charts" / "dra-accel-driver" / "values.schema.json").read_text())
    modes = {TIME_SLICING: "time-slicing", MPS: "MPS", "MIG": "MIG"}
    modes |= {m: {"exclusive": "exclusive (default)", "consumable": "consumable capacity"}[m]
              for m in schema["properties"]["gpuSharing"]["enum"]}
    assert set(modes.values()) == set(table), set(table) ^ set(modes.values())
    for row in table.values():
        assert {"enforced", "set or accounted, not enforced", "how to ask"} <= set(row), row
    # What it says, in the words the pages below are held to.
    assert table["time-slicing"]["enforced"].startswith("nothing per pod")
    assert "per process" in table["consumable capacity"]["set or accounted, not enforced"]
    assert "100 % compute" in table["consumable capacity"]["enforced"]
    assert "hardware" in table["MIG"]["enforced"]


def test_no_page_calls_what_the_table_says_is_not_enforced_enforced():
    wrong = []
    for page in user_pages():
        for clause in clauses(page.read_text()):
            if (claims_enforcement(clause) and NOT_ENFORCED_SUBJECT.search(clause)
                    and not THE_SUM.search(clause)):
                wrong.append(f"{page.relative_to(REPO)}: {clause}")
    assert wrong == [], "\n".join(wrong)


def test_the_checks_catch_what_the_pages_said_before():
    """The sentences this issue found, and their corrected forms."""
    said = ["| `gpu-consumable` | three claims packed onto one GPU, each share enforced (MPS) | `mixed` |",
            "# 1.34/1.35 with the gate); the driver enforces each share with\n# the GPU's MPS server.",
            "The driver enforces each share: the GPU's MPS server caps every process."]
    for text in said:
        assert any(claims_enforcement(c) and NOT_ENFORCED_SUBJECT.search(c) and not THE_SUM.search(c)
                   for c in clauses(text)), text
    fine = ["So a share's limits are **accounted, not enforced**.",
            "the share's limits as MPS client settings (per process, accounted rather than enforced)",
            "The shares' sum is enforced; each share's own limits are per-process settings, not enforced.",
            "Time-slicing enforces nothing per pod."]
    for text in fine:
        assert not any(claims_enforcement(c) and NOT_ENFORCED_SUBJECT.search(c) and not THE_SUM.search(c)
                       for c in clauses(text)), text


def test_links_to_the_sharing_guide_land_on_a_heading():
    headings = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", SHARING.read_text(), re.M)}
    assert github_anchor(TABLE_HEADING) in headings
    links = []
    for page in user_pages():
        links += [(page, a) for a in re.findall(r"sharing\.md#([\w-]+)", page.read_text())]
    links += [(SHARING, a) for a in re.findall(r"\]\(#([\w-]+)\)", SHARING.read_text())]
    assert links, "the pages link to the table"
    assert [f"{p.relative_to(REPO)}: #{a}" for p, a in links if a not in headings] == []
    # The example of every sharing mode points at the table.
    for example in ("gpu-timeslicing", "gpu-mps-shared-claim", "gpu-consumable"):
        readme = (REPO / "examples" / example / "README.md").read_text()
        assert f"sharing.md#{github_anchor(TABLE_HEADING)}" in readme, example
