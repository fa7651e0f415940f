"""Media URLs fetched from a real HTTP server on loopback (services/tokenizer/
media.py, media_http.py): what is refused by default, redirects, DNS answers,
byte caps, slow servers, decompression bombs, the Host and SNI a fetch sends,
and the status and body a client reads for each refusal."""
from __future__ import annotations

import asyncio
import ssl
from ipaddress import ip_network

import pytest

from services.tokenizer.media import MediaFetcher, MediaPolicy, MediaRefused
from tests.tls import TestCA
from tests.unit.tokenizer.media_fixtures import (
    body, drip, endless, expect_answer, gif, http_server, png, png_claiming, redirect, silent)

WHERE = "messages[0].content[1].image_url"
LOOPBACK = (ip_network("127.0.0.1/32"),)  # the test server's one address, allowed explicitly
KIB = 1024


def policy(**overrides) -> MediaPolicy:
    values = dict(allowed_networks=LOOPBACK, connect_timeout_s=2.0, read_timeout_s=0.3, total_timeout_s=3.0,
                  max_image_bytes=256 * KIB, max_request_bytes=400 * KIB)
    return MediaPolicy(**{**values, **overrides})


def resolver(answers: dict[str, list[str]]):
    """A DNS that knows only `answers` (what a name an attacker controls can resolve to)."""
    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]
    return resolve


async def refused(fetcher: MediaFetcher, url: str, kind: str = "image") -> MediaRefused:
    with pytest.raises(MediaRefused) as caught:
        await fetcher.fetch(kind, url, WHERE)
    return caught.value


async def expect(refusal: MediaRefused, status: int, words: str) -> None:
    await expect_answer(refusal, status, WHERE, words)


def test_loopback_and_private_addresses_are_refused_by_default() -> None:
    async def scenario() -> None:
        async with http_server({"/a.png": body(png())}) as server:
            fetcher = MediaFetcher(MediaPolicy())
            for url in (server.url("/a.png"), "http://10.1.2.3/a.png", "http://169.254.169.254/latest/meta-data/",
                        "http://[::1]/a.png", "http://100.64.0.1/a.png", "http://0.0.0.0/a.png",
                        "http://[::ffff:10.0.0.1]/a.png", "http://224.0.0.1/a.png"):
                await expect(await refused(fetcher, url), 422, "non-public address")
            assert server.requests == []  # refused before any connection
            # The operator's explicit allowance reaches it, and the server kept working through the refusals.
            item = await MediaFetcher(policy()).fetch("image", server.url("/a.png"), WHERE)
            assert item.format == "png" and item.image.size == (4, 3) and item.image.mode == "RGB"

    asyncio.run(scenario())


def test_a_redirect_is_checked_again_at_every_hop() -> None:
    async def scenario() -> None:
        async with http_server({"/a.png": body(png())}) as server:
            server.routes["/to-metadata"] = redirect("http://169.254.169.254/latest/meta-data/")
            server.routes["/to-other-loopback"] = redirect(f"http://127.0.0.2:{server.port}/a.png")
            server.routes["/to-localhost"] = redirect(f"http://localhost:{server.port}/a.png")
            server.routes["/relative"] = redirect("/a.png", 301)
            server.routes["/loop"] = redirect("/loop", 307)
            fetcher = MediaFetcher(policy(), resolve=resolver({"localhost": ["127.0.0.1", "::1"]}))
            for path in ("/to-metadata", "/to-other-loopback", "/to-localhost"):
                await expect(await refused(fetcher, server.url(path)), 422, "non-public address")
            await expect(await refused(fetcher, server.url("/loop")), 422, "redirects more than 3 times")
            assert [p for p, _ in server.requests].count("/loop") == 4
            item = await fetcher.fetch("image", server.url("/relative"), WHERE)
            assert item.format == "png"

    asyncio.run(scenario())


def test_a_name_is_refused_if_any_of_its_addresses_is_not_public() -> None:
    answers = {"media.example": ["10.0.0.7"], "mixed.example": ["93.184.215.14", "192.168.1.1"],
               "mapped.example": ["::ffff:127.0.0.1"], "nat64.example": ["64:ff9b::a00:1"],
               "sixtofour.example": ["2002:c0a8:101::1"]}
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy(), resolve=resolver(answers))
        for host in answers:
            await expect(await refused(fetcher, f"https://{host}/cat.png"), 422, "non-public address")

    asyncio.run(scenario())


def test_the_connection_goes_to_the_checked_address_with_the_name_in_host_and_sni(tmp_path) -> None:
    """A name resolves once, to the address that was checked; the request still
    names the host, and TLS sends it as SNI and checks the certificate for it."""
    ca = TestCA(tmp_path)
    pair = ca.issue("media.example", server=True)
    seen_sni: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pair.cert, pair.key)
    context.sni_callback = lambda _sock, name, _ctx: seen_sni.append(name)

    async def scenario() -> None:
        async with http_server({"/a.png": body(png())}) as server:
            fetcher = MediaFetcher(policy(), resolve=resolver({"media.example": ["127.0.0.1"]}))
            item = await fetcher.fetch("image", server.url("/a.png", "media.example"), WHERE)
            assert item.format == "png" and server.requests == [("/a.png", f"media.example:{server.port}")]
            tls = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
            port = tls.sockets[0].getsockname()[1]
            # Our test CA is no public CA: the certificate is refused, after the name went out as SNI.
            await expect(await refused(fetcher, f"https://media.example:{port}/a.png"), 422, "fetch failed")
            tls.close()
            assert seen_sni == ["media.example"]

    asyncio.run(scenario())


def test_only_allowed_domains_are_fetched_when_the_list_is_set() -> None:
    async def scenario() -> None:
        async with http_server({"/a.png": body(png())}) as server:
            fetcher = MediaFetcher(policy(allowed_domains=frozenset({"media.example"})),
                                   resolve=resolver({"media.example": ["127.0.0.1"], "evil.example": ["127.0.0.1"]}))
            assert (await fetcher.fetch("image", server.url("/a.png", "MEDIA.example"), WHERE)).format == "png"
            for host in ("evil.example", "media.example.evil.example", "127.0.0.1"):
                await expect(await refused(fetcher, server.url("/a.png", host)), 422, "not in the allowed media")
            server.routes["/away"] = redirect(server.url("/a.png", "evil.example"))
            await expect(await refused(fetcher, server.url("/away", "media.example")), 422, "not in the allowed")

    asyncio.run(scenario())


def test_a_body_over_the_cap_is_cut_off_with_413() -> None:
    async def scenario() -> None:
        async with http_server({"/declared": body(b"\x89PNG" + b"\x00" * (300 * KIB)),
                                "/endless": endless("endless")}) as server:
            fetcher = MediaFetcher(policy())
            await expect(await refused(fetcher, server.url("/declared")), 413, "more than the 262144 allowed")
            # No length announced: reading stops at the cap, long before the total deadline.
            await expect(await refused(fetcher, server.url("/endless")), 413, "more than the 262144 bytes")
            assert server.bytes_sent["endless"] < 16 * 256 * KIB
            # Each part under its own cap, together over the request's.
            server.routes["/half"] = body(png(180, 180, (1, 2, 3)) + b"\x00" * (200 * KIB))
            half = server.url("/half")
            with pytest.raises(MediaRefused) as caught:
                await fetcher.fetch_all([("image", half, WHERE), ("image", half + "?2", WHERE)])
            await expect(caught.value, 413, "the request's media exceed 409600 bytes")

    asyncio.run(scenario())


def test_a_decompression_bomb_is_refused_before_it_is_decoded() -> None:
    async def scenario() -> None:
        async with http_server({"/bomb.png": body(png_claiming(100_000, 100_000)),
                                "/big.png": body(png_claiming(5000, 5000)),
                                "/frames.gif": body(gif(40))}) as server:
            fetcher = MediaFetcher(policy(max_image_pixels=4_000_000, max_frames=32))
            await expect(await refused(fetcher, server.url("/bomb.png")), 422, "decompression bomb")
            await expect(await refused(fetcher, server.url("/big.png")), 422,
                         "5000x5000 pixels, more than the 4000000 allowed")
            await expect(await refused(fetcher, server.url("/frames.gif")), 422, "40 frames, more than the 32")

    asyncio.run(scenario())


def test_a_slow_server_is_timed_out() -> None:
    async def scenario() -> None:
        async with http_server({"/silent": silent(), "/drip": drip(0.05)}) as server:
            fetcher = MediaFetcher(policy(read_timeout_s=0.2, total_timeout_s=0.6))
            await expect(await refused(fetcher, server.url("/silent")), 422, "timed out")
            # Every read is quick; the whole fetch is not.
            await expect(await refused(fetcher, server.url("/drip")), 422, "did not finish within 0.6 s")

    asyncio.run(scenario())


def test_what_the_server_says_is_not_what_the_bytes_are() -> None:
    async def scenario() -> None:
        async with http_server({"/page.png": body(b"<html>hi</html>", "image/png"),
                                "/zipped.png": body(png(), "image/png", "Content-Encoding: gzip\r\n"),
                                "/cat": body(png(), "text/html")}) as server:
            fetcher = MediaFetcher(policy())
            await expect(await refused(fetcher, server.url("/page.png")), 422, "got data of no supported format")
            await expect(await refused(fetcher, server.url("/zipped.png")), 422, "gzip-encoded")
            await expect(await refused(fetcher, server.url("/gone.png")), 422, "answered HTTP 404")
            await expect(await refused(fetcher, server.url("/cat"), "video"), 422, "expected video")
            assert (await fetcher.fetch("image", server.url("/cat"), WHERE)).format == "png"

    asyncio.run(scenario())
