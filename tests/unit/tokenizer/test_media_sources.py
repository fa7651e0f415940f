"""Media from data URIs and from the operator's media directory, the part
count, video and audio header caps, the content-hash cache, and the policy
built from the tokenizer's config (services/tokenizer/media.py)."""
from __future__ import annotations

import asyncio
import io
import os
from ipaddress import ip_network

import pytest
from PIL import Image

from services.common.config import load_config
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.media import MediaFetcher, MediaPolicy, MediaRefused
from tests.unit.tokenizer.media_fixtures import data_uri, expect_answer, gif, mp4, png, png_claiming, wav

WHERE = "messages[0].content[0].image_url"


def jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (5, 5), (0, 90, 200)).save(out, "JPEG")
    return out.getvalue()


async def refusal_of(fetcher: MediaFetcher, kind: str, url: str, where: str = WHERE) -> MediaRefused:
    with pytest.raises(MediaRefused) as caught:
        await fetcher.fetch(kind, url, where)
    return caught.value


def test_data_uris_of_the_documented_types_are_decoded() -> None:
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy())
        item = await fetcher.fetch("image", data_uri("image/png", png(7, 2)), WHERE)
        assert (item.kind, item.format, item.image.size, item.image.mode) == ("image", "png", (7, 2), "RGB")
        assert (await fetcher.fetch("image", data_uri("image/jpg", jpeg()), WHERE)).format == "jpeg"
        audio = await fetcher.fetch("audio", data_uri("audio/wav", wav(2)), "messages[0].content[0].audio_url")
        assert (audio.format, audio.image) == ("wav", None) and audio.data == wav(2)
        streamed = wav(30, declared_bytes=0xFFFFFFFF)  # the samples present count, not the placeholder
        assert (await fetcher.fetch("audio", data_uri("audio/x-wav", streamed), WHERE)).format == "wav"
        assert (await fetcher.fetch("video", data_uri("video/mp4", mp4(10)), WHERE)).format == "mp4"

    asyncio.run(scenario())


@pytest.mark.parametrize("kind,url,status,words", [
    ("image", "data:image/png;base64,iVBORw0KGgo*", 422, "base64 payload is malformed"),
    ("image", "data:image/png;base64,iVBORw0KGgo", 422, "base64 payload is malformed"),  # unpadded
    ("image", "data:image/png,raw-bytes", 422, "must read data:image/<subtype>;base64"),
    ("image", data_uri("text/html", png()), 422, "got text/html"),
    ("image", data_uri("image/svg+xml", b"<svg/>"), 422, "got image/svg+xml"),
    ("video", data_uri("image/png", png()), 422, "got image/png"),
    ("image", data_uri("image/png", b"<html></html>"), 422, "got data of no supported format"),
    ("image", data_uri("image/png", wav(1)), 422, "got wav data"),
    ("image", data_uri("image/png", png()[:40]), 422, "the png image is not valid"),
    ("image", data_uri("image/png", png() + b"\x00" * 70_000), 413, "more than the 65536 allowed"),
    ("audio", data_uri("audio/wav", wav(601)), 422, "lasts 601 s, more than the 600 s allowed"),
    ("video", data_uri("video/mp4", mp4(3600)), 422, "lasts 3600 s, more than the 600 s allowed"),
    ("image", data_uri("image/gif", gif(5)), 422, "5 frames, more than the 4 allowed"),
    ("image", "javascript:alert(1)", 422, "must be an http(s) URL, a data: URI, or a path"),
])
def test_bad_data_uris_are_refused_with_the_documented_body(kind: str, url: str, status: int, words: str) -> None:
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy(max_image_bytes=65536, max_frames=4))
        await expect_answer(await refusal_of(fetcher, kind, url), status, WHERE, words)

    asyncio.run(scenario())


@pytest.fixture
def media_dir(tmp_path):
    """A media directory with an image, a nested one, and, outside it, a secret."""
    inside, outside = tmp_path / "media", tmp_path / "outside"
    (inside / "cats").mkdir(parents=True)
    outside.mkdir()
    (inside / "cat.png").write_bytes(png())
    (inside / "cats" / "tabby.jpeg").write_bytes(jpeg())
    (outside / "secret.png").write_bytes(png(9, 9))
    (inside / "link.png").symlink_to(outside / "secret.png")
    (inside / "elsewhere").symlink_to(outside)
    (inside / "cat.txt").write_bytes(png())
    (inside / "folder.png").mkdir()
    os.mkfifo(inside / "pipe.png")
    (inside / "large.png").write_bytes(png() + b"\x00" * 70_000)
    return inside


def test_local_files_are_read_from_the_media_directory(media_dir) -> None:
    (media_dir.parent / "mounted").symlink_to(media_dir)  # the operator's path may be a link

    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy(media_dir=str(media_dir)))
        assert (await fetcher.fetch("image", f"{media_dir}/cat.png", WHERE)).image.size == (4, 3)
        assert (await fetcher.fetch("image", f"file://{media_dir}/cats/tabby.jpeg", WHERE)).format == "jpeg"
        mounted = MediaFetcher(MediaPolicy(media_dir=str(media_dir.parent / "mounted") + "/"))
        assert (await mounted.fetch("image", f"{media_dir.parent}/mounted/cat.png", WHERE)).format == "png"

    asyncio.run(scenario())


@pytest.mark.parametrize("path,status,words", [
    ("{dir}/link.png", 422, "no such file in the media directory (symlinks are not followed)"),
    ("{dir}/elsewhere/secret.png", 422, "symlinks are not followed"),
    ("{dir}/../outside/secret.png", 422, "no '.' or '..' segments"),
    ("{dir}/./cat.png", 422, "no '.' or '..' segments"),
    ("{dir}//cat.png", 422, "only letters, digits"),
    ("{dir}/c%61t.png", 422, "only letters, digits"),
    ("{dir}X/cat.png", 422, "must lie under"),
    ("/etc/passwd", 422, "must lie under"),
    ("{dir}/cat.txt", 422, "must end in .gif, .jpeg, .jpg, .png, .webp"),
    ("{dir}/missing.png", 422, "no such file"),
    ("{dir}/folder.png", 422, "must name a regular file"),
    ("{dir}/pipe.png", 422, "must name a regular file"),
    ("{dir}/large.png", 413, "more than the 65536 allowed"),
])
def test_local_paths_out_of_the_media_directory_are_refused(media_dir, path: str, status: int, words: str) -> None:
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy(media_dir=str(media_dir), max_image_bytes=65536))
        refusal = await refusal_of(fetcher, "image", path.format(dir=media_dir))
        await expect_answer(refusal, status, WHERE, words)

    asyncio.run(scenario())


def test_a_request_with_more_than_20_media_parts_is_refused() -> None:
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy())
        uri = data_uri("image/png", png())
        parts = [("image", uri, f"messages[0].content[{i}].image_url") for i in range(20)]
        assert len(await fetcher.fetch_all(parts)) == 20
        with pytest.raises(MediaRefused) as caught:
            await fetcher.fetch_all([*parts, ("image", uri, "messages[1].content[0].image_url")])
        await expect_answer(caught.value, 422, "messages", "at most 20 media parts, got 21")

    asyncio.run(scenario())


def test_fetch_all_names_the_part_that_was_refused() -> None:
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy())
        parts = [("image", data_uri("image/png", png()), "messages[0].content[0].image_url"),
                 ("image", "http://10.0.0.1/a.png", "messages[0].content[1].image_url")]
        with pytest.raises(MediaRefused) as caught:
            await fetcher.fetch_all(parts)
        await expect_answer(caught.value, 422, "messages[0].content[1].image_url", "non-public address")

    asyncio.run(scenario())


def test_the_images_of_a_request_share_one_budget_of_decoded_pixels() -> None:
    """Each image may be up to MAX_IMAGE_PIXELS, and PNGs compress far below the
    byte caps: the pixels all parts decode to, together, are what bounds memory."""
    def parts(*images: bytes) -> list[tuple[str, str, str]]:
        return [("image", data_uri("image/png", data), f"messages[0].content[{i}].image_url")
                for i, data in enumerate(images)]

    async def over_budget(fetcher: MediaFetcher, *images: bytes) -> None:
        with pytest.raises(MediaRefused) as caught:
            await fetcher.fetch_all(parts(*images))
        # Parts decode concurrently: whichever comes second is the one over the budget.
        assert caught.value.where in {where for _, _, where in parts(*images)}
        await expect_answer(caught.value, 413, caught.value.where, "the request's images exceed 1000 pixels in all")

    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy(max_request_pixels=1000))
        small, other, large = png(20, 20, (1, 1, 1)), png(20, 20, (2, 2, 2)), png(30, 30)  # 400, 400, 900 pixels
        assert [i.image.size for i in await fetcher.fetch_all(parts(small, other))] == [(20, 20)] * 2
        await over_budget(fetcher, small, large)
        # Counted from the header, before decoding: this one would fail to decode (422) if it got that far.
        await over_budget(fetcher, png_claiming(40, 40))
        # A cached image is not decoded again, but the request still holds its pixels.
        assert (await fetcher.fetch_all(parts(large)))[0].image.size == (30, 30)
        await over_budget(fetcher, large, other)

    asyncio.run(scenario())


def test_the_same_bytes_are_checked_and_decoded_once() -> None:
    async def scenario() -> None:
        one, other = png(3, 3, (1, 1, 1)), png(3, 3, (2, 2, 2))
        fetcher = MediaFetcher(MediaPolicy(cache_bytes=2 * (len(one) + 27)))
        first = await fetcher.fetch("image", data_uri("image/png", one), WHERE)
        again = await fetcher.fetch("image", data_uri("image/png", one), "messages[3].content[0].image_url")
        assert again is first
        different = await fetcher.fetch("image", data_uri("image/png", other), WHERE)
        assert different.sha256 != first.sha256 and different.image.getpixel((0, 0)) == (2, 2, 2)
        # Bounded: a third image evicts the least recently used.
        await fetcher.fetch("image", data_uri("image/png", png(3, 3, (3, 3, 3))), WHERE)
        assert await fetcher.fetch("image", data_uri("image/png", one), WHERE) is not first

    asyncio.run(scenario())


def test_the_policy_comes_from_the_tokenizer_config() -> None:
    config = load_config(TokenizerConfig, ["--allowed-media-domains", "Media.Example, cdn.example.,[0:0::1]",
                                           "--media-allowed-networks", "10.1.0.0/16,127.0.0.1",
                                           "--media-dir", "/srv/media", "--maxRequestLength", "8",
                                           "--max-image-pixels", "1000000", "--max-request-image-pixels",
                                           "5000000"], environ={})
    policy = MediaPolicy.from_config(config)
    assert policy.allowed_domains == {"media.example", "cdn.example", "::1"}
    assert policy.allowed_networks == (ip_network("10.1.0.0/16"), ip_network("127.0.0.1/32"))
    assert (policy.media_dir, policy.max_image_bytes, policy.max_image_pixels) == ("/srv/media", 8 << 20, 1_000_000)
    assert policy.max_request_pixels == 5_000_000
    assert MediaPolicy.from_config(TokenizerConfig()) == MediaPolicy()
    with pytest.raises(ValueError, match="not a network"):
        TokenizerConfig(media_allowed_networks=("10.0.0.0/33",))
