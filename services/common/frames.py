"""Protobuf messages as length-prefixed frames on a TCP connection: the workers'
step channel (worker.proto, DescribeResponse.step_port; docs/design/step.md).

A frame is a 4-byte little-endian length, then that many bytes of one
serialized message. A gRPC message costs tens of µs of CPU in each process
(HTTP/2 framing, the completion queue, its poller thread handing the event to
asyncio); a frame on an asyncio stream costs a few. The scheduler sends a step
and reads its answer about 500 times a second per worker on a fast device,
so the steps take this path, and everything else stays on gRPC."""
from __future__ import annotations

import asyncio
import struct
from typing import Any

_HEADER = struct.Struct("<I")
# Far above any step (a step's images are bounded by MAX_STEP_IMAGE_BYTES): a
# larger length is a peer that does not speak frames.
MAX_FRAME_BYTES = 1 << 30


class FrameError(ConnectionError):
    """The connection ended inside a frame, or carried something that is not one."""


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes; None when the peer closed the connection between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("the connection ended inside a frame's header") from None
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes: the peer does not speak length-prefixed frames")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError(f"the connection ended inside a frame of {length} bytes") from None


def frame(data: bytes) -> bytes:
    """A serialized message as a frame."""
    return _HEADER.pack(len(data)) + data


def write_frame(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue one message as a frame (one write: one segment, as asyncio's TCP
    transports send without Nagle's delay); `await writer.drain()` to wait out
    a full buffer."""
    writer.write(frame(message.SerializeToString()))
