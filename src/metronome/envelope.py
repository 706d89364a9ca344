"""The one binary envelope of the bytes Metronome writes for another process to read: an engine
session's snapshot (`engine.snapshot`) and a Realtime session's checkpoint
(`serve.resume.checkpoint`, which carries a snapshot inside).

    MAGIC | version (u32 LE) | header length (u32 LE) | JSON header | payload

A reader checks the magic and the version before anything else, then reads the header (a
few KB of JSON) before it touches the payload (MBs of KV). `seal` lays the envelope out in
one buffer of the whole size, so the caller copies its payload straight in once; `open`
returns the header and where the payload starts, without copying it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

_LENGTHS = struct.Struct("<II")  # version, header length


@dataclass(frozen=True)
class Envelope:
    magic: bytes
    version: int
    what: str  # what the bytes are, for errors ("Metronome session snapshot")
    error: type[ValueError] = ValueError  # raised for bytes that are not this envelope
    reader: str = "server"  # who reads them, for errors ("this engine reads 1")

    @property
    def lead_bytes(self) -> int:
        return len(self.magic) + _LENGTHS.size

    def seal(self, header: dict, payload_bytes: int, align_bytes: int = 1
             ) -> tuple[bytearray, int]:
        """A buffer for `header` and `payload_bytes` more, and where the payload starts (the
        header padded with spaces so that it starts at a multiple of `align_bytes`)."""
        text = json.dumps(header).encode()
        lead = self.lead_bytes
        start = -(-(lead + len(text)) // align_bytes) * align_bytes
        text += b" " * (start - lead - len(text))
        out = bytearray(start + payload_bytes)
        out[:lead] = self.magic + _LENGTHS.pack(self.version, len(text))
        out[lead:start] = text
        return out, start

    def open(self, data: bytes | bytearray) -> tuple[dict, int]:
        """The header of `data` and where its payload starts; `error` if `data` is not this
        envelope at this version."""
        lead = self.lead_bytes
        if len(data) < lead or not data.startswith(self.magic):
            raise self.error(f"not a {self.what}")
        version, header_len = _LENGTHS.unpack_from(data, len(self.magic))
        if version != self.version:
            raise self.error(f"{self.what.split()[-1]} version {version}, this "
                             f"{self.reader} reads {self.version}")
        return json.loads(bytes(data[lead : lead + header_len])), lead + header_len
