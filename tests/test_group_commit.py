"""Group commit of claims' local changes (driver/prepare/committer.py) and the writes
under it (driver/state/atomic.py WriteGroup, driver/state/checkpoint.py `group`).

What must hold: nothing is renamed into place before its fsync; a caller hears back only
after its group's commit; N records cost N file fsyncs and one directory fsync; a failed
change fails its own claim, a failed commit every claim of the group, and the checkpoint's
cache never keeps a record the disk does not have."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from pathlib import Path

import pytest

from driver.state import atomic

from driver.prepare import cdi
from driver.state.checkpoint import Checkpoint, ClaimRecord, State
from driver.prepare.claims import ClaimRef
from driver.state.instance import Instance
from driver.state.locks import ProcessLock
from driver.prepare.preparer import Preparer
from driver.prepare.committer import GroupCommitter
from tests.conftest import discover_profile


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync, as "file" or "dir"."""
    seen: list[str] = []
    real = os.fsync

    def counting(fd):
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)
    monkeypatch.setattr(os, "fsync", counting)
    return seen


def record(uid: str) -> ClaimRecord:
    return ClaimRecord(uid, "ns", f"c-{uid}", State.PREPARE_COMPLETED, "boot", ())


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if atomic.TEMP_MARK in p.name)


def test_a_group_renames_nothing_before_its_commit_and_syncs_the_directory_once(tmp_path, fsyncs):
    old = tmp_path / "old.json"
    old.write_text("old")
    group = atomic.WriteGroup("me")
    for i in range(5):
        group.write(tmp_path / f"r{i}.json", b'{"n": %d}' % i)
    group.write(tmp_path / "r0.json", b'{"n": "again"}')  # staged twice: the later wins
    assert group.remove(old) and not old.exists()  # a removal is done at once
    assert not group.remove(tmp_path / "never.json")
    assert not list(tmp_path.glob("r*.json"))  # nothing staged is visible yet
    assert len(temp_files(tmp_path)) == 5 and fsyncs == []
    group.commit()
    assert (tmp_path / "r0.json").read_text() == '{"n": "again"}'
    assert [(tmp_path / f"r{i}.json").read_text() for i in range(1, 5)] == [f'{{"n": {i}}}' for i in range(1, 5)]
    assert fsyncs == ["file"] * 5 + ["dir"]
    assert temp_files(tmp_path) == []


def test_a_group_whose_fsync_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    group = atomic.WriteGroup("me")
    for i in range(3):
        group.write(tmp_path / f"r{i}.json", b"{}")

    def broken(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="Input/output error"):
        group.commit()
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_cache_sees_staged_records_and_forgets_them_if_not_committed(tmp_path):
    instance = Instance.register(tmp_path / "state", None)
    checkpoint = Checkpoint(tmp_path / "state", instance)
    checkpoint.put(record("a"))
    with pytest.raises(RuntimeError):
        with checkpoint.group():
            checkpoint.put(record("b"))
            checkpoint.remove("a")
            # Later claims of the same group are checked against the staged state.
            assert [r.uid for r in checkpoint.records()] == ["b"]
            raise RuntimeError("a change blew up before the commit")
    # b was never renamed into place; a's removal was done on disk (just not synced).
    assert [r.uid for r in checkpoint.records()] == []
    assert checkpoint.uids() == []
    with checkpoint.group() as group:
        checkpoint.put(record("c"))
        checkpoint.commit(group)
    assert [r.uid for r in checkpoint.records()] == ["c"] == checkpoint.uids()


def blocked_committer(tmp_path):
    instance = Instance.register(tmp_path / "state", None)
    checkpoint = Checkpoint(tmp_path / "state", instance)
    return checkpoint, GroupCommitter(checkpoint)


def test_changes_that_arrive_during_a_commit_share_the_next_one(tmp_path, fsyncs):
    checkpoint, committer = blocked_committer(tmp_path)
    release = threading.Event()

    def first(uid):
        release.wait(10)
        checkpoint.put(record(uid))
        return uid

    def change(uid):
        checkpoint.put(record(uid))
        # The answer comes only after the commit: the record is not there yet.
        assert not checkpoint.path(uid).exists()
        return uid

    async def main():
        head = asyncio.ensure_future(committer.run(first, "u0"))
        await asyncio.sleep(0.05)  # the committer thread now waits in `first`
        rest = [asyncio.ensure_future(committer.run(change, f"u{i}")) for i in range(1, 11)]
        await asyncio.sleep(0.05)
        release.set()
        done = await asyncio.gather(head, *rest)
        # Every caller hears back after its record is durable and in place.
        assert all(checkpoint.path(uid).exists() for uid in done)
        return done
    assert asyncio.run(main()) == [f"u{i}" for i in range(11)]
    assert (committer.groups, committer.changes) == (2, 11)
    # 11 records: 11 file fsyncs, and one directory fsync per group rather than 11.
    assert fsyncs.count("file") == 11 and fsyncs.count("dir") == 2
    committer.close()


def test_a_failed_change_fails_its_claim_and_a_failed_commit_every_claim_of_its_group(tmp_path, monkeypatch):
    checkpoint, committer = blocked_committer(tmp_path)
    release = threading.Event()

    def put(uid):
        if uid == "bad":
            raise ValueError("this claim's own mistake")
        if uid == "gate":
            release.wait(10)
        checkpoint.put(record(uid))
        return uid

    async def group_of(*uids):
        head = asyncio.ensure_future(committer.run(put, "gate"))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(committer.run(put, uid)) for uid in uids]
        await asyncio.sleep(0.05)
        release.set()
        outcome = await asyncio.gather(head, *rest, return_exceptions=True)
        release.clear()
        return outcome

    ok, bad = asyncio.run(group_of("ok", "bad"))[1:]
    assert ok == "ok" and isinstance(bad, ValueError)
    assert checkpoint.uids() == ["gate", "ok"]

    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    outcome = asyncio.run(group_of("x", "y"))
    assert all(isinstance(o, OSError) for o in outcome)
    assert checkpoint.uids() == ["gate", "ok"]  # nothing of the failed group is in place
    assert sorted(r.uid for r in checkpoint.records()) == ["gate", "ok"]  # nor in the cache
    monkeypatch.setattr(os, "fsync", real)
    assert asyncio.run(committer.run(put, "z")) == "z"  # and the next group works
    assert temp_files(checkpoint.directory) == []
    committer.close()


def test_two_claims_for_one_device_in_one_group_are_checked_against_each_other(tmp_path):
    """The exclusivity check of the later claim sees the earlier claim's staged record."""
    node, result = discover_profile("mixed", tmp_path / "m")
    instance = Instance.register(tmp_path / "state", None)
    gpu = "gpu-0000-11-00-0"

    class Reader:
        async def read(self, ref):
            return {"metadata": {"uid": ref.uid}, "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": "accel.dra.io", "pool": "n", "device": gpu}]}}}}

    checkpoint = Checkpoint(tmp_path / "state", instance)
    preparer = Preparer(driver="accel.dra.io", pool="n", inventory=lambda: result.inventory,
                        claims=Reader(), cdi_writer=cdi.CdiWriter(tmp_path / "cdi", "accel.dra.io", instance),
                        checkpoint=checkpoint, boot_id="b", dev_root=node.dev,
                        process_lock=ProcessLock(tmp_path / "lock"))
    release = threading.Event()

    async def main():
        gate = asyncio.ensure_future(preparer.committer.run(lambda: release.wait(10)))
        await asyncio.sleep(0.05)
        both = asyncio.ensure_future(preparer.prepare([ClaimRef("ns", "a", "0a-1"), ClaimRef("ns", "b", "0b-2")]))
        await asyncio.sleep(0.2)
        release.set()
        await gate
        return await both
    outcomes = asyncio.run(main())
    assert preparer.committer.groups == 2  # the gate, then both claims together
    errors = sorted(o.error for o in outcomes.values())
    assert errors[0] == "" and f"device {gpu} is already prepared for claim ns/" in errors[1]
    assert len(checkpoint.uids()) == 1
    preparer.committer.close()


def test_the_committer_thread_goes_when_idle_and_comes_back_with_the_next_claim(tmp_path, monkeypatch):
    from driver.prepare import committer as module

    monkeypatch.setattr(module, "IDLE_SECONDS", 0.1)
    checkpoint, committer = blocked_committer(tmp_path)

    def put(uid):
        checkpoint.put(record(uid))
        return threading.current_thread().name
    assert asyncio.run(committer.run(put, "a")) == "claim-commits"
    deadline = 50
    while committer._thread is not None and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    assert committer._thread is None and committer._fsyncs is None
    assert asyncio.run(committer.run(put, "b")) == "claim-commits"
    assert checkpoint.uids() == ["a", "b"]
    committer.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(committer.run(put, "c"))
