"""`explain --blocking` against the real allocator (issue 41, items 2 and 6): on generated
fragmented layouts (tests/blocking_layouts.py: scattered GPUs, MIG-like partitions on
shared counters, shares, NICs on the GPUs' roots, mixed; one in five asked for by a pod of
two claims), seeded from BLOCKING_SEED (1),
until BLOCKING_COUNT (1000) of them have a blocking set: hack/allocator-oracle places the
request once the set's claims are gone, and not with any one of them put back; the first
BLOCKING_EXHAUSTIVE (200) sets are also held to every smaller set of claims (none lets
it place the request: the set is the smallest). Layouts where explain says the request
fits, or that no removal can help, are checked too. Without Go these are skipped; under
CI=true they fail instead."""

from __future__ import annotations

import json
import os

import pytest

import blocking_layouts as layouts
import differential as diff

COUNT = int(os.environ.get("BLOCKING_COUNT", "1000"))
SEED = int(os.environ.get("BLOCKING_SEED", "1"))
EXHAUSTIVE = int(os.environ.get("BLOCKING_EXHAUSTIVE", "200"))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    process = diff.started_oracle(tmp_path_factory.mktemp("oracle"))
    yield process
    process.close()


def test_blocking_sets_agree_with_the_allocator(oracle):
    result = layouts.run(oracle, SEED, COUNT, max_layouts=COUNT * 4, exhaustive=EXHAUSTIVE)
    print(f"seed {SEED}: {json.dumps({k: v for k, v in result.items() if k != 'disagreements'})}")
    assert result["counts"]["blocked"] == COUNT
    # every kind of fragmentation is among them, pods of two claims too, and sets of more
    # than one claim
    assert {kind.split(" ")[0] for kind in result["blocked by kind"]} == set(layouts.KINDS)
    assert sum(n for kind, n in result["blocked by kind"].items() if "pod" in kind) >= COUNT // 10
    assert max(result["set sizes"]) >= 3
    assert result["counts"]["hopeless"] > 0 and result["counts"]["fits"] > 0
    assert not result["disagreements"], json.dumps(result["disagreements"][:5], indent=1)


def test_the_check_catches_a_set_that_is_not_minimal(oracle, monkeypatch):
    """The check itself: a blocking set with one claim too many is reported."""
    from driver.explain import blocking

    real = blocking.node_blocking

    def padded(claims, node, world, limit=blocking.SEARCH_LIMIT):
        answer = real(claims, node, world, limit)
        extra = [c for c in world.claims if f"default/{c['metadata']['name']}" not in {h.claim for h in answer.claims}]
        if answer.helps and not answer.fits and extra:
            answer.claims.append(blocking.Held(f"default/{extra[0]['metadata']['name']}", [], []))
        return answer

    monkeypatch.setattr(blocking, "node_blocking", padded)
    result = layouts.run(oracle, SEED, 30, max_layouts=200)
    assert any("not minimal" in p for d in result["disagreements"] for p in d["problems"])
