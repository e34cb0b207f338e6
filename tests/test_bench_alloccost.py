"""bench/alloccost.py drives the real allocator (hack/allocator-oracle's "bench" op): every
case's claim fits an empty node and a half-full one, the held claims are real allocations
(the allocator then walks past them: a node costs more), and the command prints a row per
case with its ratio to the baseline. No figure is asserted: the numbers are the bench's."""

from __future__ import annotations

import shutil

import pytest

from bench import alloccost, fleet
from tests.differential import build_oracle

pytestmark = pytest.mark.skipif(shutil.which("go") is None, reason="Go builds hack/allocator-oracle")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return build_oracle(tmp_path_factory.mktemp("oracle"))


@pytest.mark.parametrize("case", alloccost.CASES, ids="/".join)
def test_every_case_fits_empty_and_half_full_nodes(oracle, case):
    shape, workload = case
    for fill in (0.0, 0.5):
        cost = alloccost.measure(oracle, shape, workload, nodes=2, repeat=5, fill=fill, profile=None)
        assert cost.ns_per_node > 0 and cost.devices >= 8


def test_held_claims_take_whole_gpus_the_claim_then_cannot_get(oracle, tmp_path):
    shape = fleet.SHAPES["mixed"]
    built = alloccost.node_slices(shape, fleet.mock_inventory(shape), "n0")
    held = alloccost.held_claims(shape, built, "n0", 1.0)
    gpus = {d["name"] for s in built for d in s["spec"].get("devices", ())
            if d["attributes"]["type"]["string"] == "gpu"}
    assert {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in held} == gpus
    with pytest.raises(SystemExit, match="fits no node"):  # every GPU held: nothing left
        alloccost.measure(oracle, "mixed", "gpu", nodes=1, repeat=1, fill=1.0, profile=None)


def test_the_command_prints_each_case_against_the_baseline(capsys, monkeypatch, oracle):
    monkeypatch.setattr(alloccost, "build_oracle", lambda: oracle)
    assert alloccost.main(["--nodes", "2", "--repeat", "5", "--case", "mixed/aligned"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[:2] for r in rows[1:]] == [["baseline", "gpu"], ["mixed", "aligned"]]
    assert rows[1].endswith("1.0x") and rows[2].endswith("x")


def test_an_unknown_case_is_one_line(capsys):
    with pytest.raises(SystemExit):
        alloccost.main(["--case", "mixed/fpga"])
    assert "unknown case mixed/fpga" in capsys.readouterr().err
