"""What media fetching is given and gives back: the operator's policy, one
fetched item, and the refusal a client reads (media.py re-exports all three)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network

import grpc
from PIL import Image

from services.common.errors import PAYLOAD_TOO_LARGE, ServiceError
from services.common.media_parts import MAX_MEDIA_PARTS

MIB = 1024 * 1024
KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from and how much of it a request may bring."""

    allowed_domains: frozenset[str] = frozenset()  # exact lower-case host names; empty = any public host
    media_dir: str = "/data/multimodal_inputs/"
    # Non-public networks (loopback, RFC 1918, link-local, CGNAT...) media URLs may still reach.
    allowed_networks: tuple[IPv4Network | IPv6Network, ...] = ()
    max_image_bytes: int = 40 * MIB
    max_video_bytes: int = 512 * MIB
    max_audio_bytes: int = 40 * MIB
    max_request_bytes: int = 1000 * MIB  # all media of one request together
    max_parts: int = MAX_MEDIA_PARTS  # media parts in one request
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0  # longest wait for the next bytes
    total_timeout_s: float = 60.0  # one fetch, redirects included
    max_redirects: int = 3
    max_image_pixels: int = Image.MAX_IMAGE_PIXELS  # width x height, checked before decoding
    max_request_pixels: int = 100_000_000  # all images of one request together, decoded (300 MB as RGB)
    max_frames: int = 1000  # animated images and video
    max_seconds: float = 600.0  # video and audio duration
    cache_bytes: int = 256 * MIB  # fetched media kept by content hash

    @classmethod
    def from_config(cls, config) -> MediaPolicy:
        """The policy of a TokenizerConfig (services/tokenizer/config.py)."""
        return cls(
            allowed_domains=frozenset(_host_entry(d) for d in config.allowed_media_domains),
            media_dir=config.media_dir,
            allowed_networks=tuple(ip_network(n, strict=False) for n in config.media_allowed_networks),
            max_image_bytes=config.max_request_mib * MIB,
            max_video_bytes=config.max_video_mib * MIB,
            max_audio_bytes=config.max_request_mib * MIB,
            max_request_bytes=config.max_request_media_mib * MIB,
            connect_timeout_s=config.media_connect_timeout_s,
            read_timeout_s=config.media_read_timeout_s,
            total_timeout_s=config.media_fetch_timeout_s,
            max_image_pixels=config.max_image_pixels,
            max_request_pixels=config.max_request_image_pixels,
            max_frames=config.max_media_frames,
            max_seconds=config.max_media_seconds,
            cache_bytes=config.media_cache_mib * MIB,
        )

    def max_bytes(self, kind: str) -> int:
        return {"image": self.max_image_bytes, "video": self.max_video_bytes, "audio": self.max_audio_bytes}[kind]


def _host_entry(entry: str) -> str:
    """An allowlist entry as media_http.parse_url writes hosts: lower case, no
    trailing dot, IPv6 addresses compressed and without brackets."""
    host = entry.strip().lower().rstrip(".")
    try:
        return str(ip_address(host.strip("[]")))
    except ValueError:
        return host


@dataclass(frozen=True)
class MediaItem:
    kind: str  # "image" | "video" | "audio"
    data: bytes  # the raw bytes as fetched
    format: str  # identified from the bytes: png, jpeg, webp, gif, mp4, avi, wmv, wav, mp3, flac
    sha256: str  # hex digest of `data`
    image: Image.Image | None  # images: decoded, verified, RGB; None for video and audio. Shared through
    # the cache by every request that sends the same bytes: read it, never change it in place.


class MediaRefused(ServiceError):
    """A media part the request may not use: HTTP 422, or 413 when it is too
    large, with a message naming the part (`where`) and the reason."""

    def __init__(self, reason: str, status: int = 422, where: str = ""):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {reason}" if where else reason,
                         error_reason=PAYLOAD_TOO_LARGE if status == 413 else "")
        self.status = status
        self.where = where
        self.reason = reason

    def at(self, where: str) -> MediaRefused:
        """The same refusal naming the part it is about."""
        return MediaRefused(self.reason, self.status, where)


def too_large(reason: str) -> MediaRefused:
    return MediaRefused(reason, 413)


class Budget:
    """What a request's media may still bring of one quantity (bytes fetched,
    pixels decoded); the parts of one request share it, from several threads."""

    def __init__(self, limit: int, noun: str, unit: str):
        self.limit = limit
        self.noun = noun  # what the refusal says: "the request's <noun> exceed <limit> <unit> in all"
        self.unit = unit
        self.used = 0
        self._lock = threading.Lock()  # local files and data URIs are read, and images decoded, in threads

    def take(self, amount: int) -> None:
        with self._lock:
            if self.used + amount > self.limit:
                raise too_large(f"the request's {self.noun} exceed {self.limit} {self.unit} in all")
            self.used += amount


@dataclass(frozen=True)
class RequestBudget:
    """The bytes a request's media may bring, and the pixels its images may decode to."""

    data: Budget
    pixels: Budget

    @classmethod
    def of(cls, policy: MediaPolicy) -> RequestBudget:
        return cls(Budget(policy.max_request_bytes, "media", "bytes"),
                   Budget(policy.max_request_pixels, "images", "pixels"))


class ItemReader:
    """Counts one item's bytes against its own cap and the request's budget."""

    def __init__(self, kind: str, max_bytes: int, budget: Budget):
        self.kind = kind
        self.max_bytes = max_bytes
        self.budget = budget
        self.chunks: list[bytes] = []
        self.size = 0

    def check_declared(self, num_bytes: int) -> None:
        """Refuses an item whose announced size is over its cap before it is read."""
        if num_bytes > self.max_bytes:
            raise too_large(f"the {self.kind} is {num_bytes} bytes, more than the {self.max_bytes} allowed")

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise too_large(f"the {self.kind} is more than the {self.max_bytes} bytes allowed")
        self.budget.take(len(chunk))
        self.chunks.append(chunk)

    def data(self) -> bytes:
        return b"".join(self.chunks)
