"""Fetching a client's http(s) media URL without letting it reach what the
client cannot (SSRF).

Each hop: the URL is parsed once, strictly, by `parse_url` (anything another
parser could read differently is refused: backslashes, user info, numeric host
forms other than a dotted quad, bytes outside RFC 3986), and that one parse is
what is checked and what is fetched. The host is resolved once and every
address must be public (or in a network the operator allows); the
connection goes to the first checked address, with the name kept in the Host
header and the TLS SNI and certificate check. Redirects are followed here, a
few at most, each hop checked again. The body streams under the item's byte
cap and the request's, with no content decoding."""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import certifi
import httpx

from services.tokenizer.media_types import ItemReader, MediaPolicy, MediaRefused

MAX_URL_CHARS = 4096
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# RFC 3986 characters; '%' must start an escape.
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://([^/?#]*)([^#]*)")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9\-]{0,61}[a-z0-9])?")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # no leading zero: 010 is octal to some
_DOTTED_QUAD = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)")
_CHUNK = 64 * 1024

Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class ParsedUrl:
    scheme: str  # "http" | "https"
    host: str  # lower-case name, dotted quad, or IPv6 address without brackets
    port: int
    target: str  # path and query, as sent in the request line

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == _DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host_header}{self.target}"


def parse_url(url: str) -> ParsedUrl:
    """The one parse of an http(s) URL, or MediaRefused for anything ambiguous."""
    if len(url) > MAX_URL_CHARS:
        raise MediaRefused(f"the URL is longer than {MAX_URL_CHARS} characters")
    if not _URL_CHARS.fullmatch(url) or _BAD_ESCAPE.search(url):
        raise MediaRefused("the URL holds characters outside RFC 3986 (backslash, space, control or non-ASCII) "
                           "or a bad %-escape")
    match = _URL.fullmatch(url.split("#", 1)[0])
    if match is None:
        raise MediaRefused("the URL is not scheme://host/path")
    scheme, authority, target = match.group(1).lower(), match.group(2), match.group(3)
    if scheme not in _DEFAULT_PORTS:
        raise MediaRefused(f"the URL scheme must be http or https, got {scheme}")
    if "@" in authority:
        raise MediaRefused("the URL may not carry user information (user@host)")
    if authority.startswith("["):
        host, sep, port_text = authority[1:].partition("]")
        if not sep or (port_text and not port_text.startswith(":")):
            raise MediaRefused("the URL's IPv6 host is malformed")
        port_text = port_text[1:]
        if "%" in host:
            raise MediaRefused("the URL's IPv6 host is malformed: zone ids are not accepted")
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise MediaRefused("the URL's IPv6 host is malformed") from None
    else:
        host, _, port_text = authority.partition(":")
        host = _check_host(host.lower())
    port = _DEFAULT_PORTS[scheme]
    if port_text or authority.endswith(":"):
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise MediaRefused("the URL's port must be a number in [1, 65535]")
        port = int(port_text)
    if target.startswith("?") or not target:
        target = "/" + target
    return ParsedUrl(scheme, host, port, target)


def _check_host(host: str) -> str:
    name = host[:-1] if host.endswith(".") else host
    if _DOTTED_QUAD.fullmatch(name):
        return name
    labels = name.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        # WHATWG parsers read 127.1, 0x7f.0.0.1 or 2130706433 as an IPv4 address; others as a name.
        raise MediaRefused("the URL's host is an IPv4 address in a form other than a dotted quad")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise MediaRefused("the URL's host is not a valid host name")
    return name


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Globally routable unicast. IPv4-mapped (::ffff:0:0/96), NAT64 (64:ff9b::/96)
    and Teredo addresses lie in reserved or special ranges and are refused whole;
    a 6to4 address is as public as the IPv4 address inside it."""
    if (not address.is_global or address.is_multicast or address.is_reserved or address.is_loopback
            or address.is_link_local or address.is_unspecified or address.is_private):
        return False
    if isinstance(address, ipaddress.IPv6Address):
        if address.is_site_local:
            return False
        if address.sixtofour is not None:
            return is_public(address.sixtofour)
    return True


async def system_resolve(host: str, port: int) -> list[str]:
    """Every address the system resolver gives `host`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         proto=socket.IPPROTO_TCP)
    return [info[4][0] for info in infos]


class HttpFetcher:
    def __init__(self, policy: MediaPolicy, resolve: Resolver):
        self.policy = policy
        self.resolve = resolve
        self.ssl_context = ssl.create_default_context(cafile=certifi.where())
        self.timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)

    async def fetch(self, url: str, reader: ItemReader) -> bytes:
        """The body at `url`, through at most `max_redirects` checked redirects."""
        try:
            async with asyncio.timeout(self.policy.total_timeout_s):
                parsed = parse_url(url)
                for _ in range(self.policy.max_redirects + 1):
                    location = await self._get(parsed, reader)
                    if location is None:
                        return reader.data()
                    parsed = parse_url(urllib.parse.urljoin(str(parsed), location))
                raise MediaRefused(f"the URL redirects more than {self.policy.max_redirects} times")
        except TimeoutError:
            raise MediaRefused(f"the media fetch did not finish within {self.policy.total_timeout_s:g} s") from None
        except httpx.TimeoutException as exc:
            raise MediaRefused(f"the media server timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise MediaRefused(f"the media fetch failed ({type(exc).__name__})") from None

    async def _address(self, parsed: ParsedUrl) -> str:
        """The checked address to connect to for `parsed`."""
        if self.policy.allowed_domains and parsed.host not in self.policy.allowed_domains:
            raise MediaRefused(f"the host {parsed.host} is not in the allowed media domains")
        try:
            literal = ipaddress.ip_address(parsed.host)
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in await self.resolve(parsed.host,
                                                                                                parsed.port)]
            except OSError:
                raise MediaRefused(f"the host {parsed.host} does not resolve") from None
            if not addresses:
                raise MediaRefused(f"the host {parsed.host} does not resolve")
        refused = [a for a in addresses if not is_public(a)
                   and not any(a in network for network in self.policy.allowed_networks)]
        if refused:
            raise MediaRefused(f"the host {parsed.host} resolves to a non-public address ({refused[0]}); "
                               "media may come from public addresses only")
        return str(addresses[0])

    async def _get(self, parsed: ParsedUrl, reader: ItemReader) -> str | None:
        """Reads the body into `reader`, or returns the Location of a redirect."""
        address = await self._address(parsed)
        literal = f"[{address}]" if ":" in address else address
        request_url = f"{parsed.scheme}://{literal}:{parsed.port}{parsed.target}"
        headers = {"Host": parsed.host_header, "Accept-Encoding": "identity", "User-Agent": "stormserve-media"}
        extensions = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
        # A client per hop: a pooled connection would be keyed by address, not by name and SNI.
        async with httpx.AsyncClient(verify=self.ssl_context, timeout=self.timeout, trust_env=False,
                                     follow_redirects=False) as client:
            async with client.stream("GET", request_url, headers=headers, extensions=extensions) as response:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaRefused(f"the media server answered HTTP {response.status_code} without a "
                                           "Location")
                    return location
                if response.status_code != 200:
                    raise MediaRefused(f"the media server answered HTTP {response.status_code}")
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding != "identity":
                    raise MediaRefused(f"the media server sent a {encoding}-encoded body")
                length = response.headers.get("content-length", "")
                if length.isdigit():
                    reader.check_declared(int(length))
                async for chunk in response.aiter_raw(_CHUNK):
                    reader.add(chunk)
        return None
