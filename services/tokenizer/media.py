"""Media parts of a request (image_url, video_url, audio_url) as checked bytes.

A part names its media one of three ways: an http(s) URL (media_http.py: the
SSRF-safe fetch), a `data:<kind>/<subtype>;base64,` URI, or a path under the
operator's media directory (`/data/...` or `file:///data/...`). Whatever the
source, the bytes are capped (per item and per request), identified from
their own leading bytes, and checked for their kind (media_formats.py); an
image's pixels count against the request's pixel budget before it is decoded,
and it is decoded once, and kept by content hash so the same bytes are not
decoded twice. Every refusal is a MediaRefused naming the part: 413 for size,
422 for anything else."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import os
import re
import stat
from collections import OrderedDict

from services.tokenizer.media_formats import check_container, decode_image, identify
from services.tokenizer.media_http import HttpFetcher, Resolver, system_resolve
from services.tokenizer.media_types import (
    KINDS, Budget, ItemReader, MediaItem, MediaPolicy, MediaRefused, RequestBudget)

__all__ = ["MediaFetcher", "MediaItem", "MediaPolicy", "MediaRefused"]

_DATA_URI = re.compile(r"data:([a-z]+)/([a-z0-9.+\-]+);base64,", re.IGNORECASE)
_PATH_SEGMENT = re.compile(r"[\w.\-]+", re.ASCII)
# Subtypes a data URI may declare, per kind: the formats, and their common aliases.
_SUBTYPES = {
    "image": {"png", "jpeg", "jpg", "webp", "gif"},
    "video": {"mp4", "avi", "x-msvideo", "x-ms-wmv", "x-ms-asf", "wmv"},
    "audio": {"wav", "x-wav", "wave", "mpeg", "mp3", "flac", "x-flac"},
}
_EXTENSIONS = {"image": {".png", ".jpg", ".jpeg", ".webp", ".gif"}, "video": {".mp4", ".avi", ".wmv"},
               "audio": {".wav", ".mp3", ".flac"}}
_CHUNK = 1024 * 1024


class MediaFetcher:
    """Fetches and checks the media parts of requests under one policy.
    `resolve` is the DNS lookup (the system's unless given)."""

    def __init__(self, policy: MediaPolicy, resolve: Resolver = system_resolve):
        self.policy = policy
        self.http = HttpFetcher(policy, resolve)
        self._cache: OrderedDict[str, MediaItem] = OrderedDict()
        self._cache_bytes = 0

    async def fetch(self, kind: str, url: str, where: str) -> MediaItem:
        """One part, alone under the request's budget."""
        return await self._fetch(kind, url, where, RequestBudget.of(self.policy))

    async def fetch_all(self, parts: list[tuple[str, str, str]]) -> list[MediaItem]:
        """Every (kind, url, where) of one request, concurrently, under one
        budget of bytes and decoded pixels; the first refusal ends the others."""
        if len(parts) > self.policy.max_parts:
            raise MediaRefused(f"a request may hold at most {self.policy.max_parts} media parts, got {len(parts)}",
                               where="messages")
        budget = RequestBudget.of(self.policy)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._fetch(kind, url, where, budget)) for kind, url, where in parts]
        except* MediaRefused as refused:
            raise refused.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _fetch(self, kind: str, url: str, where: str, budget: RequestBudget) -> MediaItem:
        if kind not in KINDS:
            raise ValueError(f"unknown media kind {kind!r}")
        reader = ItemReader(kind, self.policy.max_bytes(kind), budget.data)
        try:
            scheme = url[:8].lower()
            if scheme.startswith("data:"):
                await asyncio.to_thread(self._read_data_uri, kind, url, reader)
            elif scheme.startswith(("http://", "https://")):
                await self.http.fetch(url, reader)
            elif url.startswith("/") or scheme.startswith("file://"):
                await asyncio.to_thread(self._read_local, kind, url, reader)
            else:
                raise MediaRefused("must be an http(s) URL, a data: URI, or a path under the media directory")
            return await self._checked(kind, reader.data(), budget.pixels)
        except MediaRefused as exc:
            raise exc.at(where) from None

    def _read_data_uri(self, kind: str, url: str, reader: ItemReader) -> None:
        match = _DATA_URI.match(url)
        if match is None:
            raise MediaRefused(f"a data URI must read data:{kind}/<subtype>;base64,<data>")
        major, subtype = match.group(1).lower(), match.group(2).lower()
        if major != kind or subtype not in _SUBTYPES[kind]:
            raise MediaRefused(f"the data URI of a {kind} part must be {kind}/ one of "
                               f"{', '.join(sorted(_SUBTYPES[kind]))}, got {major}/{subtype}")
        payload = url[match.end():]
        reader.check_declared(len(payload) // 4 * 3)
        try:
            reader.add(base64.b64decode(payload, validate=True))
        except binascii.Error:
            raise MediaRefused("the data URI's base64 payload is malformed") from None

    def _read_local(self, kind: str, url: str, reader: ItemReader) -> None:
        """Reads a file under media_dir, opening each path segment with
        O_NOFOLLOW from its parent, so no symlink and no `..` can lead out,
        even if the tree changes while it is read."""
        path = url[7:] if url[:7].lower() == "file://" else url
        root = self.policy.media_dir.rstrip("/") + "/"
        if not path.startswith(root):
            raise MediaRefused(f"a local media path must lie under {root}")
        segments = path[len(root):].split("/")
        if not all(_PATH_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments):
            raise MediaRefused("a local media path may hold only letters, digits, '_', '.' and '-' per segment, "
                               "and no '.' or '..' segments")
        if os.path.splitext(segments[-1])[1].lower() not in _EXTENSIONS[kind]:
            raise MediaRefused(f"a local {kind} file must end in {', '.join(sorted(_EXTENSIONS[kind]))}")
        nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            # The operator's own path may pass through symlinks (a mounted volume); the client's part may not.
            fd = os.open(os.path.realpath(root), nofollow | os.O_DIRECTORY)
        except OSError:
            raise MediaRefused("the media directory is not available on this server") from None
        try:
            for segment in segments[:-1]:
                next_fd = os.open(segment, nofollow | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = next_fd
            file_fd = os.open(segments[-1], nofollow | os.O_NONBLOCK, dir_fd=fd)
        except OSError:
            raise MediaRefused("no such file in the media directory (symlinks are not followed)") from None
        finally:
            os.close(fd)
        info = os.fstat(file_fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(file_fd)
            raise MediaRefused("a local media path must name a regular file")
        with os.fdopen(file_fd, "rb") as file:
            reader.check_declared(info.st_size)
            while chunk := file.read(_CHUNK):
                reader.add(chunk)

    async def _checked(self, kind: str, data: bytes, pixels: Budget) -> MediaItem:
        # Hashing and decoding hundreds of MiB is CPU work: threads, off the event loop.
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        cached = self._cache.get(digest)
        if cached is not None and cached.kind == kind:
            self._cache.move_to_end(digest)
            if cached.image is not None:  # decoded before, it still counts: this request's processor reads it
                pixels.take(cached.image.width * cached.image.height)
            return cached
        fmt, image = await asyncio.to_thread(self._inspect, kind, data, pixels)
        item = MediaItem(kind=kind, data=data, format=fmt, sha256=digest, image=image)
        self._remember(item)
        return item

    def _inspect(self, kind: str, data: bytes, pixels: Budget):
        fmt = identify(kind, data)
        if kind == "image":
            return fmt, decode_image(data, fmt, self.policy, pixels)
        check_container(kind, fmt, data, self.policy)
        return fmt, None

    def _remember(self, item: MediaItem) -> None:
        size = _entry_bytes(item)
        if size > self.policy.cache_bytes:
            return
        old = self._cache.pop(item.sha256, None)
        if old is not None:
            self._cache_bytes -= _entry_bytes(old)
        self._cache[item.sha256] = item
        self._cache_bytes += size
        while self._cache_bytes > self.policy.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= _entry_bytes(evicted)


def _entry_bytes(item: MediaItem) -> int:
    """What a cached item holds in memory: its bytes and its decoded RGB pixels."""
    return len(item.data) + (item.image.width * item.image.height * 3 if item.image is not None else 0)
