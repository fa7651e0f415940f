"""The step channel: StepStream's messages as length-prefixed frames on TCP
connections of their own (services/common/frames.py), beside the gRPC server,
on the port Describe reports (step_port). One connection is one step stream,
run by the servicer exactly as StepStream runs (server.py): same ordering,
same failure answer (a StepStreamResponse with `error`), same drain rules.

What gRPC would send as the stream's status (a refusal while draining, the
drain's timeout) goes as a last frame with `error`, then the connection
closes. A connection that ends, from either side, ends the stream: the worker
forgets its sequences."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from services.common.errors import status_proto
from services.common.frames import read_frame, write_frame
from services.common.tls import InternalTls
from services.worker.server import WorkerServicer
from stormserve.worker.v1 import worker_pb2

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 5.0


async def serve_step_channel(servicer: WorkerServicer, host: str, port: int,
                             tls: InternalTls | None) -> asyncio.Server:
    """Listen (port 0 picks one) and record the port for Describe (`servicer.step_port`)."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_stream(servicer, reader, writer)

    server = await asyncio.start_server(on_connection, host, port,
                                        ssl=tls.server_ssl_context() if tls is not None else None)
    servicer.step_port = server.sockets[0].getsockname()[1]
    return server


async def _serve_stream(servicer: WorkerServicer, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
    async def requests():
        while (frame := await read_frame(reader)) is not None:
            yield worker_pb2.StepStreamRequest.FromString(frame)

    try:
        async with aclosing(servicer.step_stream(requests())) as responses:  # its end forgets the sequences now
            async for response in responses:
                write_frame(writer, response)
                await writer.drain()
    except ConnectionError as exc:  # the scheduler went, or spoke no frames: the stream ends
        log.info("step channel from %s ended: %s", writer.get_extra_info("peername"), exc)
    except Exception as exc:  # noqa: BLE001 - what gRPC would end the stream with: the last frame
        write_frame(writer, worker_pb2.StepStreamResponse(error=status_proto(exc)))
        await _close_after_last_frame(reader, writer)
    finally:
        writer.close()


async def _close_after_last_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Let the caller read the last frame: send it and the end (where TCP has a
    half-close), and wait, dropping what it still sends, until it closes (at
    most CLOSE_WAIT_S). Closing with its data unread would reset the
    connection, which may drop the frame before the caller reads it."""
    try:
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        await asyncio.wait_for(_until_closed(reader), CLOSE_WAIT_S)
    except (ConnectionError, asyncio.TimeoutError):
        pass


async def _until_closed(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass
