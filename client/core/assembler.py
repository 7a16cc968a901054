"""The reassembly of one gRPC Get stream straight into the caller's buffers, with the
verification of every page (the hand-built decoding is client/core/frames.py's).

Pure: no I/O; the shell feeds it what the stream delivers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from client.contract.errors import Corrupt
from client.contract.page import PageHeader
from client.contract.scope import Scope
from client.core.frames import TAG_GET_CHUNK, TAG_GET_MISSING, ChunkView, decode_chunk_message
from client.core.requests import malformed
from kvstore_pb import store_pb2 as pb

log = logging.getLogger(__name__)

_PENDING, _RECEIVING, _COMPLETE, _MISSING, _BAD = range(5)


class GetAssembler:
    """Reassembles one Get stream straight into the caller's buffers and verifies every page.

    Feed it each GetResponse in order, then call `finish()`. A page whose header does not decode,
    names another key or scope, does not fit its buffer, arrives out of order or incomplete, or
    fails its checksum (when `verify`) is a miss, counted in `corrupt`; its buffer's contents are
    then unspecified. A message naming a page index outside the call breaks the contract and
    raises a malformed-reply StrataError. Each page is verified as its last byte arrives, while
    it is still in the CPU cache.
    """

    def __init__(
        self, scope: Scope, keys: Sequence[bytes], into: Sequence[memoryview], *, verify: bool
    ) -> None:
        self._scope_digest = scope.digest
        self._keys = keys
        self._into = into
        self._verify = verify
        count = len(keys)
        self._state = [_PENDING] * count
        self._headers: list[PageHeader | None] = [None] * count
        self._received = [0] * count
        self.corrupt = 0

    def feed(self, msg: pb.GetResponse) -> None:
        part = msg.WhichOneof("part")
        if part == "missing":
            self._missing(msg.missing)
        elif part == "chunk":
            self._chunk(msg.chunk)
        else:
            raise malformed("empty GetResponse")

    def feed_message(self, raw: bytes) -> None:
        """Feed one serialized GetResponse (from a call made with `raw_bytes` as its response
        deserializer): chunk data is copied straight from the message into its buffer."""
        chunk = decode_chunk_message(raw, TAG_GET_CHUNK)
        if chunk is not None:
            self._chunk(chunk)
            return
        if len(raw) == 2 and raw[0] == TAG_GET_MISSING and raw[1] < 0x80:
            self._missing(raw[1])
            return
        try:
            msg = pb.GetResponse.FromString(raw)
        except DecodeError:
            raise malformed("undecodable GetResponse") from None
        self.feed(msg)

    def finish(self) -> tuple[PageHeader | None, ...]:
        """The header of each delivered page, None for each miss."""
        result: list[PageHeader | None] = []
        for index, state in enumerate(self._state):
            header = self._headers[index]
            if state == _RECEIVING and header is not None:
                self._drop(index, f"incomplete: {self._received[index]} of {header.payload_bytes}")
            result.append(header if state == _COMPLETE else None)
        return tuple(result)

    def _index(self, index: int) -> int:
        if index >= len(self._keys):
            raise malformed(f"page index {index} in a get of {len(self._keys)} keys")
        return index

    def _drop(self, index: int, why: str) -> None:
        if self._state[index] != _BAD:
            self.corrupt += 1
            self._state[index] = _BAD
        log.debug("get: page %d dropped: %s", index, why)

    def _missing(self, index: int) -> None:
        index = self._index(index)
        if self._state[index] == _PENDING:
            self._state[index] = _MISSING
        else:
            self._drop(index, "reported missing after data")

    def _chunk(self, chunk: pb.PageChunk | ChunkView) -> None:
        index = self._index(chunk.index)
        state = self._state[index]
        if state == _BAD:
            return
        if state == _MISSING:
            self._drop(index, "data after a missing report")
            return
        if state == _PENDING:
            if not self._start(index, chunk.header):
                return
            state = _RECEIVING
        elif chunk.header:
            self._drop(index, "a second header")
            return
        header = self._headers[index]
        assert header is not None
        data = chunk.data
        start = self._received[index]
        end = start + len(data)
        if chunk.offset != start or end > header.payload_bytes:
            self._drop(index, f"chunk at {chunk.offset}+{len(data)}, expected offset {start}")
            return
        if end == start:
            if state == _COMPLETE or end < header.payload_bytes:
                return  # an empty chunk changes nothing
        else:
            self._into[index][start:end] = data
            self._received[index] = end
            if end < header.payload_bytes:
                return
        if self._verify:
            try:
                header.verify_payload(self._into[index][:end])
            except Corrupt as exc:
                self._drop(index, str(exc))
                return
        self._state[index] = _COMPLETE

    def _start(self, index: int, raw: bytes) -> bool:
        try:
            header = PageHeader.decode(raw)
        except Corrupt as exc:
            self._drop(index, f"header: {exc}")
            return False
        if header.key != self._keys[index] or header.scope_digest != self._scope_digest:
            self._drop(index, "header names another key or scope")
            return False
        if header.payload_bytes > self._into[index].nbytes:
            self._drop(index, f"payload of {header.payload_bytes} bytes does not fit its buffer")
            return False
        self._headers[index] = header
        self._state[index] = _RECEIVING
        return True
