"""What fetched bytes are, from the bytes alone (never a Content-Type or a file
name), and the checks each kind must pass before anything uses it: an image's
size before it is decoded, then PIL's verify() and a full decode; the frames
and duration a container header states, where it can be read cheaply."""
from __future__ import annotations

import io
import struct

from PIL import Image

from services.tokenizer.media_types import Budget, MediaPolicy, MediaRefused

# Formats a kind may be, as MindIE documents them (webp and gif beside jpeg and png, as OpenAI's API).
FORMATS = {
    "image": ("png", "jpeg", "webp", "gif"),
    "video": ("mp4", "avi", "wmv"),
    "audio": ("wav", "mp3", "flac"),
}
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF"}
_ASF_GUID = bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c")
# Headers come first: a file that needs more chunks or boxes to reach them is not read further.
_MAX_HEADER_CHUNKS = 64


def sniff(data: bytes) -> str | None:
    """The format the leading bytes announce, None if none we take."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF":
        return {b"WEBP": "webp", b"AVI ": "avi", b"WAVE": "wav"}.get(head[8:12])
    if head[4:8] == b"ftyp":
        return "mp4"
    if head == _ASF_GUID:
        return "wmv"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def identify(kind: str, data: bytes) -> str:
    fmt = sniff(data)
    if fmt not in FORMATS[kind]:
        found = f"{fmt} data" if fmt else "data of no supported format"
        raise MediaRefused(f"expected {kind} ({', '.join(FORMATS[kind])}), got {found}")
    return fmt


def decode_image(data: bytes, fmt: str, policy: MediaPolicy, pixels: Budget) -> Image.Image:
    """The first frame as RGB, once the declared size, the frame count, the
    request's pixel budget (`pixels`) and verify() have passed. CPU-heavy: call
    it off the event loop."""
    formats = [_PIL_FORMATS[fmt]]
    try:
        # Image.open reads the header only (and refuses twice PIL's own pixel limit itself).
        with Image.open(io.BytesIO(data), formats=formats) as image:
            width, height = image.size
            if width * height > policy.max_image_pixels:
                raise MediaRefused(f"the image is {width}x{height} pixels, more than the "
                                   f"{policy.max_image_pixels} allowed")
            num_frames = getattr(image, "n_frames", 1)
            if num_frames > policy.max_frames:
                raise MediaRefused(f"the image has {num_frames} frames, more than the {policy.max_frames} allowed")
            pixels.take(width * height)
        with Image.open(io.BytesIO(data), formats=formats) as image:
            image.verify()
        with Image.open(io.BytesIO(data), formats=formats) as image:
            return image.convert("RGB")
    except MediaRefused:
        raise
    except Image.DecompressionBombError:
        raise MediaRefused(f"the image declares more than twice the {Image.MAX_IMAGE_PIXELS} pixels PIL decodes "
                           "(a decompression bomb)") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        raise MediaRefused(f"the {fmt} image is not valid: {exc}") from None


def check_container(kind: str, fmt: str, data: bytes, policy: MediaPolicy) -> None:
    """Refuses video or audio whose header states more frames or seconds than
    allowed. Read: WAV and FLAC duration, MP4 duration (mvhd), AVI frames and
    duration (avih). MP3 and WMV are bounded by their byte cap only."""
    if fmt == "wav":
        seconds, frames = _wav_seconds(data), None
    elif fmt == "flac":
        seconds, frames = _flac_seconds(data), None
    elif fmt == "mp4":
        seconds, frames = _mp4_seconds(data), None
    elif fmt == "avi":
        seconds, frames = _avi_seconds_frames(data)
    else:
        return
    if seconds is not None and seconds > policy.max_seconds:
        raise MediaRefused(f"the {kind} lasts {seconds:.0f} s, more than the {policy.max_seconds:g} s allowed")
    if frames is not None and frames > policy.max_frames:
        raise MediaRefused(f"the {kind} has {frames} frames, more than the {policy.max_frames} allowed")


def _riff_chunks(data: bytes, start: int, end: int):
    """(id, body start, body end) of the RIFF chunks in data[start:end]."""
    at = start
    for _ in range(_MAX_HEADER_CHUNKS):
        if at + 8 > end:
            return
        chunk_id, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        yield chunk_id, body, min(body + size, end)
        at = body + size + (size & 1)


def _wav_seconds(data: bytes) -> float | None:
    byte_rate = None
    for chunk_id, body, end in _riff_chunks(data, 12, len(data)):
        if chunk_id == b"fmt " and end - body >= 12:
            byte_rate = struct.unpack_from("<I", data, body + 8)[0]
        elif chunk_id == b"data" and byte_rate:
            # The samples present (a streamed WAV declares 0xFFFFFFFF bytes; a decoder reads what is there).
            return (end - body) / byte_rate
    return None


def _flac_seconds(data: bytes) -> float | None:
    if len(data) < 26:
        return None
    fields = int.from_bytes(data[18:26], "big")  # STREAMINFO: rate 20 bits, channels 3, depth 5, samples 36
    rate, samples = fields >> 44, fields & (2**36 - 1)
    return samples / rate if rate and samples else None


def _mp4_boxes(data: bytes, start: int, end: int):
    at = start
    for _ in range(_MAX_HEADER_CHUNKS):
        if at + 8 > end:
            return
        size, box = struct.unpack_from(">I4s", data, at)
        header = 8
        if size == 1 and at + 16 <= end:
            size, header = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = end - at
        if size < header:
            return
        yield box, at + header, min(at + size, end)
        at += size


def _mp4_seconds(data: bytes) -> float | None:
    for box, body, end in _mp4_boxes(data, 0, len(data)):
        if box != b"moov":
            continue
        for inner, start, stop in _mp4_boxes(data, body, end):
            if inner != b"mvhd" or stop - start < 32:
                continue
            if data[start] == 1:
                timescale, duration = struct.unpack_from(">IQ", data, start + 20)
            else:
                timescale, duration = struct.unpack_from(">II", data, start + 12)
            return duration / timescale if timescale else None
    return None


def _avi_seconds_frames(data: bytes) -> tuple[float | None, int | None]:
    for chunk_id, body, end in _riff_chunks(data, 12, len(data)):
        if chunk_id != b"LIST" or data[body:body + 4] != b"hdrl":
            continue
        for inner, start, stop in _riff_chunks(data, body + 4, end):
            if inner == b"avih" and stop - start >= 20:
                usec_per_frame, _, _, _, frames = struct.unpack_from("<5I", data, start)
                return frames * usec_per_frame / 1e6, frames
    return None, None
