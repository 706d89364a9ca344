"""The checkpoint format and the store's rules (`resume.checkpoint`): a checkpoint round-trips;
appends follow their put and a newer put drops what it covers; a claim needs the session's
token and key (constant-time comparison, an unknown session answered alike), moves the
session for good and spends the token; the old owner's writes are refused after it; the
byte bound and expiry hold under any sequence of operations (property test)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.serve.resume.checkpoint import Checkpoint, CheckpointError, CheckpointShelf
from metronome.serve.resume.lease import Credentials


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _shelf(max_bytes: int = 1000, expire_after_s: float = 10.0) -> tuple[CheckpointShelf,
                                                                          Clock]:
    clock = Clock()
    return CheckpointShelf(expire_after_s, max_bytes, clock), clock


def test_a_checkpoint_round_trips_and_other_bytes_are_refused():
    checkpoint = Checkpoint({"id": "sess_1", "items": ["é"]}, bytearray(b"\x00\x01kv"), 7)
    back = Checkpoint.from_bytes(checkpoint.to_bytes())
    assert (back.state, bytes(back.engine), back.client_seq) == (
        checkpoint.state, b"\x00\x01kv", 7)
    for bad in (b"", b"METRONOME-SNAPSHOT" + b"\x00" * 16, b"x" * 100):
        with pytest.raises(CheckpointError):
            Checkpoint.from_bytes(bad)


def test_appends_follow_their_checkpoint_and_a_claim_moves_the_session():
    shelf, _ = _shelf()
    creds = Credentials.of("token", "key")
    assert not shelf.append("s", "a", 0, "e0")  # nothing to replay onto yet
    assert shelf.put("s", "a", b"c" * 10, 0, creds)
    for seq in range(3):
        assert shelf.append("s", "a", seq, f"e{seq}")
    assert shelf.put("s", "a", b"d" * 10, 2, creds)  # covers e0, e1
    assert shelf.describe("s")["logged_events"] == 1
    for token, key in (("wrong", "key"), ("token", "other key"), (None, "key")):
        assert shelf.claim("s", token, key, "b") is None
    assert shelf.claim("nope", "token", "key", "b") is None
    assert shelf.describe("s")["owner"] == "a"  # refused claims changed nothing
    claim = shelf.claim("s", "token", "key", "b")
    assert (claim.checkpoint, claim.events, claim.owner_before) == (b"d" * 10, ["e2"], "a")
    assert shelf.claim("s", "token", "key", "c") is None  # the token is spent
    assert shelf.claimed_away("s", "a") and not shelf.claimed_away("s", "b")
    assert not shelf.put("s", "a", b"x", 5, creds)  # the old owner is refused
    assert not shelf.append("s", "a", 3, "late")
    shelf.forget("s", "a")  # ... and cannot forget it
    assert shelf.describe("s")["owner"] == "b" and not shelf.describe("s")["resumable"]
    new = Credentials.of("token2", "key")
    assert shelf.regrant("s", "b", new)
    assert shelf.describe("s")["resumable"]
    assert shelf.claim("s", "token2", "key", "c") is not None


def test_the_byte_bound_refuses_and_idle_entries_expire():
    shelf, clock = _shelf(max_bytes=25, expire_after_s=5.0)
    creds = Credentials.of("t", "k")
    assert shelf.put("s1", "a", b"x" * 20, 0, creds)
    assert not shelf.put("s2", "a", b"y" * 10, 0, creds)  # 30 > 25
    assert shelf.put("s1", "a", b"x" * 25, 1, creds)  # a replacement counts once
    clock.now_s = 6.0
    assert shelf.put("s2", "a", b"y" * 10, 0, creds)  # s1 expired first
    assert shelf.describe("s1") is None and shelf.num_bytes == 10


OPS = st.lists(st.tuples(
    st.sampled_from(["put", "append", "claim", "claim_wrong", "forget", "tick"]),
    st.sampled_from(["s1", "s2", "s3"]), st.sampled_from(["a", "b"]),
    st.integers(min_value=1, max_value=40)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_store_keeps_its_bounds_under_any_sequence(ops):
    shelf, clock = _shelf(max_bytes=100, expire_after_s=5.0)
    creds = Credentials.of("t", "k")
    seqs: dict[str, int] = {}
    for op, sid, owner, size in ops:
        if op == "put":
            seqs[sid] = seqs.get(sid, 0) + size % 3
            shelf.put(sid, owner, b"z" * size, seqs[sid], creds)
        elif op == "append":
            seqs[sid] = seqs.get(sid, 0) + 1
            shelf.append(sid, owner, seqs[sid], "e")
        elif op == "claim":
            if shelf.claim(sid, "t", "k", owner) is not None:
                shelf.regrant(sid, owner, creds)
                assert shelf.describe(sid)["owner"] == owner
        elif op == "claim_wrong":
            before = shelf.describe(sid)
            assert shelf.claim(sid, "x", "k", owner) is None
            assert shelf.describe(sid) == before
        elif op == "forget":
            shelf.forget(sid, owner)
        else:
            clock.now_s += size / 10
        assert 0 <= shelf.num_bytes <= 100
        for s in ("s1", "s2", "s3"):
            entry = shelf.describe(s)
            assert entry is None or entry["checkpoint_bytes"] > 0
