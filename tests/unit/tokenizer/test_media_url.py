"""The one parse of a media URL (services/tokenizer/media_http.py): what another
URL parser could read as a different host is refused, never guessed at; and
which addresses count as public."""
from __future__ import annotations

import asyncio
import ipaddress

import pytest

from services.tokenizer.media import MediaFetcher, MediaPolicy, MediaRefused
from services.tokenizer.media_http import ParsedUrl, is_public, parse_url
from tests.unit.tokenizer.media_fixtures import expect_answer

WHERE = "messages[2].content[0].image_url"


@pytest.mark.parametrize("url,words", [
    # The backslash that split vLLM's allowlist check from its fetch (CVE-2026-24779).
    ("http://allowed.example\\@127.0.0.1/a.png", "outside RFC 3986"),
    ("http://allowed.example\\.evil.example/a.png", "outside RFC 3986"),
    ("http://allowed.example@127.0.0.1/a.png", "user information"),
    ("http://user:pass@allowed.example/a.png", "user information"),
    ("http://allowed.example%2f@127.0.0.1/a.png", "user information"),
    ("http://allowed.example:80@127.0.0.1/a.png", "user information"),
    ("http://allowed.example\t/a.png", "outside RFC 3986"),
    ("http://allowed.example /a.png", "outside RFC 3986"),
    ("http://allowed.\u0435xample/a.png", "outside RFC 3986"),  # a Cyrillic e
    ("http://allowed.example/%zz.png", "bad %-escape"),
    ("http://127.1/a.png", "other than a dotted quad"),
    ("http://0x7f.0.0.1/a.png", "other than a dotted quad"),
    ("http://2130706433/a.png", "other than a dotted quad"),
    ("http://0177.0.0.1/a.png", "other than a dotted quad"),
    ("http://127.000.000.001/a.png", "other than a dotted quad"),
    ("http://%61llowed.example/a.png", "not a valid host name"),
    ("http://allowed_example/a.png", "not a valid host name"),
    ("http://allowed.example:80:80/a.png", "port must be a number"),
    ("http://allowed.example:0/a.png", "port must be a number"),
    ("http://[::1%25lo]/a.png", "IPv6 host is malformed"),
    ("http://[::1]x/a.png", "IPv6 host is malformed"),
    ("ftp://allowed.example/a.png", "must be an http(s) URL"),
    ("gopher://allowed.example/a.png", "must be an http(s) URL"),
    ("http:/allowed.example/a.png", "must be an http(s) URL"),
    ("http://" + "a" * 4100 + ".example/a.png", "longer than 4096"),
])
def test_url_tricks_are_refused_with_the_documented_body(url: str, words: str) -> None:
    async def scenario() -> None:
        fetcher = MediaFetcher(MediaPolicy(allowed_domains=frozenset({"allowed.example"})))
        with pytest.raises(MediaRefused) as caught:
            await fetcher.fetch("image", url, WHERE)
        await expect_answer(caught.value, 422, WHERE, words)

    asyncio.run(scenario())


@pytest.mark.parametrize("url,parsed", [
    ("HTTPS://Allowed.Example/a.png", ParsedUrl("https", "allowed.example", 443, "/a.png")),
    ("http://allowed.example./a.png?x=1#frag", ParsedUrl("http", "allowed.example", 80, "/a.png?x=1")),
    # What WHATWG and RFC 3986 parsers agree on: the host ends at '/', '?' or '#'.
    ("http://allowed.example#@127.0.0.1/", ParsedUrl("http", "allowed.example", 80, "/")),
    ("http://allowed.example?@127.0.0.1/", ParsedUrl("http", "allowed.example", 80, "/?@127.0.0.1/")),
    ("http://allowed.example:8080", ParsedUrl("http", "allowed.example", 8080, "/")),
    ("http://[0:0::1]:81/a", ParsedUrl("http", "::1", 81, "/a")),
    ("http://10.0.0.1/a", ParsedUrl("http", "10.0.0.1", 80, "/a")),
])
def test_a_url_is_parsed_once_into_what_is_checked_and_fetched(url: str, parsed: ParsedUrl) -> None:
    assert parse_url(url) == parsed


@pytest.mark.parametrize("address,public", [
    ("93.184.215.14", True), ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.0.1", False), ("192.168.0.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.251", False),
    ("240.0.0.1", False), ("255.255.255.255", False), ("198.18.0.1", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("fec0::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("64:ff9b::a00:1", False),
    ("64:ff9b::5db8:d70e", False), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),  # NAT64, Teredo
    ("2002:a00:1::1", False), ("2002:5db8:d70e::1", True), ("2001:db8::1", False),
])
def test_which_addresses_are_public(address: str, public: bool) -> None:
    assert is_public(ipaddress.ip_address(address)) is public
