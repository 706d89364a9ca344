"""Snapshot and restore of one bounded session: its whole engine state as bytes.

A bounded session's state is O(S + W) and constant (DESIGN, semantics 9): its resident KV
blocks (sink blocks and window, every layer), its absolute token count, the input it was fed
and has not read yet (from its stream) and its own last sampled token when that is still to
be written, its generation budget, its sampler's generator and its spec (policy, sampling,
limits). That is everything the next step reads, so a restored session continues
token-exact.

    snapshot = take(engine, session)             # engine thread, between steps
    data = snapshot.to_bytes()                   # any thread; to a store that outlives the replica
    ok = restore(other_engine, SessionSnapshot.from_bytes(data), stream)  # False: pool exhausted

A restored session's unread input goes into its new stream (which must be empty), fed.

Ownership: this module reads and writes a session's blocks in `KVCache` and sets up the
`Session` and `BlockTable` of a restored one; the pool still owns which ids are free.

**Thread rule.** Take and restore only on the engine's thread, between steps (a runtime
driver: `WallDriver.call_on_engine`, or the beat's own thread). A step on another thread
would write the very blocks being copied and move the window under the copy. `Engine`
records the thread that steps it; both functions assert they run on that thread.

Unbounded sessions are refused (`SnapshotError`): their state grows with the conversation,
so no bounded cost can be promised for keeping or moving it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

from metronome.engine.sampling import SamplingParams
from metronome.engine.session import Session, SessionSpec
from metronome.envelope import Envelope
from metronome.kv.residency import ResidencyPolicy

_ALIGN_BYTES = 64  # every tensor starts aligned, so it is viewed from the payload, not copied


class SnapshotError(ValueError):
    """A session that cannot be snapshotted, or a snapshot this engine cannot restore."""


ENVELOPE = Envelope(b"METRONOME-SNAPSHOT", 1, "Metronome session snapshot", SnapshotError,
                    reader="engine")


@dataclass(frozen=True)
class KVGeometry:
    """What a snapshot's KV bytes mean; a restoring engine must match it exactly."""

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | ...
    block_size: int


@dataclass(frozen=True)
class SessionSnapshot:
    geometry: KVGeometry
    spec: SessionSpec
    stop_token_ids: tuple[int, ...]
    num_tokens: int  # absolute: the position the next token is written at
    logical_blocks: tuple[int, ...]  # resident logical block indices, increasing
    k: torch.Tensor  # (layers, kv_heads, blocks, block_size, head_dim)
    v: torch.Tensor  # same
    pending: tuple[torch.Tensor, ...]  # fed input not read yet, head first
    feedback: tuple[int, ...]  # its own sampled token, written before that input
    carry: tuple[int, ...]  # last sampled token, written with the next input
    decode_budget: int
    generator_state: torch.Tensor  # (n,) uint8: the sampler's torch.Generator
    ended: bool
    reply: tuple[int, ...] = ()  # its latest reply, while it can be rewound
    hold_from: int | None = None  # that reply's start: the rewind horizon

    @property
    def kv_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def to_bytes(self) -> bytearray:
        """The envelope (`metronome.envelope`): a JSON header, then the tensors' raw bytes.

        Not `torch.save`: its pickle runs code on load unless every reader remembers
        `weights_only`, and these bytes come back from a store another process wrote. The
        flat form also lets a reader check the header (model, geometry, block count) before
        it touches the MBs of KV, and each tensor is copied once, straight into the buffer
        (and on load viewed from it, not copied).
        """
        tensors = {"k": self.k, "v": self.v, "generator_state": self.generator_state}
        for i, chunk in enumerate(self.pending):
            tensors[f"pending.{i}"] = chunk
        layout: dict[str, dict[str, Any]] = {}
        offset = 0
        for name, tensor in tensors.items():
            offset = _aligned(offset)
            layout[name] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape),
                            "offset": offset}
            offset += tensor.nbytes
        out, start = ENVELOPE.seal({
            "geometry": asdict(self.geometry),
            "spec": _spec_to_json(self.spec),
            "stop_token_ids": list(self.stop_token_ids),
            "num_tokens": self.num_tokens,
            "logical_blocks": list(self.logical_blocks),
            "pending": len(self.pending),
            "feedback": list(self.feedback),
            "carry": list(self.carry),
            "decode_budget": self.decode_budget,
            "ended": self.ended,
            "reply": list(self.reply),
            "hold_from": self.hold_from,
            "tensors": layout,
            "payload_bytes": offset,
        }, offset, align_bytes=_ALIGN_BYTES)  # every tensor starts aligned in the buffer
        payload = torch.frombuffer(out, dtype=torch.uint8)[start:]
        for name, tensor in tensors.items():
            at = layout[name]["offset"]
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
            payload[at : at + tensor.nbytes].copy_(raw)
        return out

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> SessionSnapshot:
        """The inverse of `to_bytes` (its tensors view `data` when it is a bytearray);
        `SnapshotError` for bytes that are not a snapshot."""
        header, start = ENVELOPE.open(data)
        if len(data) - start != header["payload_bytes"]:
            raise SnapshotError(f"snapshot payload is {len(data) - start} bytes, its header "
                                f"says {header['payload_bytes']}")
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)[start:]
        tensors = {name: _view(raw, entry) for name, entry in header["tensors"].items()}
        pending = tuple(tensors[f"pending.{i}"] for i in range(header["pending"]))
        return cls(
            geometry=KVGeometry(**header["geometry"]),
            spec=_spec_from_json(header["spec"]),
            stop_token_ids=tuple(header["stop_token_ids"]),
            num_tokens=header["num_tokens"],
            logical_blocks=tuple(header["logical_blocks"]),
            k=tensors["k"], v=tensors["v"], pending=pending,
            feedback=tuple(header["feedback"]), carry=tuple(header["carry"]),
            decode_budget=header["decode_budget"],
            generator_state=tensors["generator_state"], ended=header["ended"],
            reply=tuple(header.get("reply", ())), hold_from=header.get("hold_from"),
        )


def geometry_of(engine) -> KVGeometry:
    cfg = engine.model.config
    return KVGeometry(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                      _dtype_name(engine.model.dtype), engine.config.block_size)


def take(engine, session: Session) -> SessionSnapshot:
    """Copy `session`'s state out of `engine` (engine thread, between steps)."""
    _check_engine_thread(engine)
    if not session.spec.policy.bounded:
        raise SnapshotError(
            f"session {session.id} is unbounded: its KV grows with the conversation, "
            "so it is not snapshotted and cannot be resumed elsewhere; open it under a bound "
            "(e.g. sinks_window:S:W) to make it resumable")
    table = session.table
    block_ids = torch.tensor(table.block_ids, dtype=torch.int64)
    k, v = (_by_block(store, engine.config.block_size).index_select(2, block_ids)
            for store in (engine.cache.k, engine.cache.v))
    return SessionSnapshot(
        geometry=geometry_of(engine), spec=session.spec,
        stop_token_ids=tuple(sorted(session.stop_token_ids)), num_tokens=table.num_tokens,
        logical_blocks=tuple(table.logical_to_block_id), k=k, v=v,
        pending=_unread(session), feedback=_one(session.feedback), carry=_one(session.carry),
        decode_budget=session.decode_budget,
        generator_state=session.generator.get_state(), ended=session.ended,
        reply=tuple(session.reply), hold_from=table.hold_from,
    )


def restore(engine, snapshot: SessionSnapshot, stream) -> bool:
    """Open `snapshot` in `engine` as `stream` (a new `metronome.stream.Stream`, empty, with
    the snapshot's spec), its blocks from `engine`'s own pool. False when the pool cannot
    supply the blocks (nothing changed); `SnapshotError` when the snapshot is for another
    model, dtype or block size."""
    _check_engine_thread(engine)
    here = geometry_of(engine)
    if snapshot.geometry != here:
        raise SnapshotError(f"snapshot of {snapshot.geometry} cannot be restored into an "
                            f"engine of {here}")
    assert stream.received_tokens == 0, stream
    block_ids = engine.pool.allocate(len(snapshot.logical_blocks))
    if block_ids is None:
        return False
    stream.spec = snapshot.spec
    try:
        engine.open_session(stream)
    except Exception:
        engine.pool.free(block_ids)
        raise
    index = torch.tensor(block_ids, dtype=torch.int64)
    for store, saved in ((engine.cache.k, snapshot.k), (engine.cache.v, snapshot.v)):
        _by_block(store, here.block_size).index_copy_(2, index, saved)
    session = engine.sessions[stream.id]
    session.table.num_tokens = snapshot.num_tokens
    session.table.logical_to_block_id = dict(zip(snapshot.logical_blocks, block_ids,
                                                  strict=True))
    for chunk in snapshot.pending:
        stream.append(chunk.clone())
    stream.fed_tokens = session.fed_tokens = stream.received_tokens
    session.feedback = snapshot.feedback[0] if snapshot.feedback else None
    session.carry = snapshot.carry[0] if snapshot.carry else None
    session.decode_budget = snapshot.decode_budget
    session.stop_token_ids = frozenset(snapshot.stop_token_ids)
    session.generator.set_state(snapshot.generator_state.clone())
    session.ended = snapshot.ended
    session.reply, session.table.hold_from = list(snapshot.reply), snapshot.hold_from
    return True


def _unread(session: Session) -> tuple[torch.Tensor, ...]:
    """Copies of the fed input the session has not read yet."""
    unread = session.fed_tokens - session.read_tokens
    if unread == 0:
        return ()
    parts, start = [], session.read_tokens
    while start < session.fed_tokens:  # one kind per read: a run at a time
        part = session.stream.read(start, session.fed_tokens - start).clone()
        parts.append(part)
        start += int(part.shape[0])
    return tuple(parts)


def _one(token: int | None) -> tuple[int, ...]:
    return () if token is None else (token,)


def _check_engine_thread(engine) -> None:
    stepper = engine.step_thread_id
    assert stepper is None or stepper == threading.get_ident(), (
        "snapshot/restore off the engine's thread: run it there between steps "
        "(e.g. WallDriver.call_on_engine)")


def _by_block(store: torch.Tensor, block_size: int) -> torch.Tensor:
    """(layers, kvh, slots, hd) -> (layers, kvh, blocks, block_size, hd), a view."""
    layers, kv_heads, slots, head_dim = store.shape
    return store.view(layers, kv_heads, slots // block_size, block_size, head_dim)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN_BYTES) * _ALIGN_BYTES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _view(raw: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    shape = entry["shape"]
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    start = entry["offset"]
    if start + nbytes > raw.numel():
        raise SnapshotError(f"snapshot tensor at {start} (+{nbytes}) overruns the payload")
    return raw[start : start + nbytes].view(dtype).view(shape)


def _spec_to_json(spec: SessionSpec) -> dict:
    policy = spec.policy
    return {"policy": str(policy), "sampling": asdict(spec.sampling),
            "max_session_tokens": spec.max_session_tokens,
            "return_logits": spec.return_logits,
            "stop_token_ids": None if spec.stop_token_ids is None else list(spec.stop_token_ids)}


def _spec_from_json(data: dict) -> SessionSpec:
    stop = data["stop_token_ids"]
    return SessionSpec(
        policy=ResidencyPolicy.parse(data["policy"]),
        sampling=SamplingParams(**data["sampling"]),
        max_session_tokens=data["max_session_tokens"],
        return_logits=data["return_logits"],
        stop_token_ids=None if stop is None else tuple(stop),
    )
