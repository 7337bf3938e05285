"""An image part's bytes from its URL: a data URL, or an http(s) URL fetched with a size cap, a
timeout, a domain allow-list and no private address unless allowed (a URL fetcher is an SSRF door)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import httpx

_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*?)(?P<base64>;base64)?,(?P<data>.*)", re.S | re.I)
_REDIRECTS = {301, 302, 303, 307, 308}


class MediaError(Exception):
    """The request's media cannot be used: a 400 naming the part (`param`) and why."""


@dataclass(frozen=True)
class MediaPolicy:
    """What the gateway fetches (its flags: --media-fetch-timeout-s, --max-media-bytes,
    --allowed-media-domains, --allow-private-media-urls)."""

    timeout_s: float = 5.0
    max_bytes: int = 20 * 2**20
    allowed_domains: tuple[str, ...] = ()  # empty: any
    allow_private: bool = False
    max_redirects: int = 3


async def fetch(url: str, policy: MediaPolicy) -> bytes:
    if url[:5].lower() == "data:":
        return _data_url(url, policy)
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch_http(url, policy)
    except TimeoutError:
        raise MediaError(f"fetching {_shown(url)} took more than {policy.timeout_s:g}s (--media-fetch-timeout-s)") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching {_shown(url)} failed: {type(exc).__name__}: {exc}") from None


def _shown(url: str) -> str:
    return repr(url if len(url) <= 120 else url[:117] + "...")


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise MediaError("a data URL must read data:<media type>[;base64],<data>")
    media_type = match["type"].lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"a data URL of {media_type!r} is not an image")
    encoded = match["data"]
    if len(encoded) > policy.max_bytes * 4 // 3 + 4:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-media-bytes)")
    try:
        data = base64.b64decode(encoded, validate=True) if match["base64"] else unquote_to_bytes(encoded)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's base64 is not valid") from None
    if len(data) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-media-bytes)")
    return data


async def _fetch_http(url: str, policy: MediaPolicy) -> bytes:
    """Each hop's host resolved once, checked, and connected to at that address (a second lookup
    could answer otherwise: DNS rebinding); https verifies the certificate for the host's name."""
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            parts = urlsplit(url)
            if parts.scheme.lower() not in ("http", "https"):
                raise MediaError(f"an image URL's scheme must be http, https or data, not {parts.scheme!r}")
            host = parts.hostname
            if not host:
                raise MediaError(f"the image URL {_shown(url)} has no host")
            if policy.allowed_domains and host.lower() not in policy.allowed_domains:
                raise MediaError(f"the host {host!r} is not among --allowed-media-domains")
            address = await _checked_address(host, parts.port or (443 if parts.scheme.lower() == "https" else 80), policy)
            literal = f"[{address}]" if ":" in address else address
            target = parts._replace(netloc=f"{literal}:{parts.port}" if parts.port else literal).geturl()
            request = client.build_request("GET", target, headers={"Host": parts.netloc.rsplit("@", 1)[-1]},
                                           extensions={"sni_hostname": host})
            response = await client.send(request, stream=True)
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching {_shown(url)} answered HTTP {response.status_code}")
                return await _body(response, policy)
            finally:
                await response.aclose()
    raise MediaError(f"fetching {_shown(url)} redirected more than {policy.max_redirects} times")


async def _checked_address(host: str, port: int, policy: MediaPolicy) -> str:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MediaError(f"the image URL's host {host!r} does not resolve: {exc.strerror}") from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
        if not ip.is_global and not policy.allow_private:
            raise MediaError(f"the image URL's host {host!r} is a private address ({ip}); the gateway fetches "
                             "public ones only unless started with --allow-private-media-urls")
    return addresses[0]


async def _body(response: httpx.Response, policy: MediaPolicy) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-media-bytes)")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-media-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
