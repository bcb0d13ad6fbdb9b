"""Image bytes from a URL: ``data:`` URLs decoded, http(s) URLs fetched under limits.

http(s) fetching goes through :func:`switchyard.media.hosts.check_host` for the
first URL and for every redirect (at most :data:`MAX_REDIRECTS`), reads the
body as a stream and stops as soon as it passes the byte limit, and gives the
whole fetch (resolution, connection, every redirect, the last byte) the time
limit: a host that sends one byte a second cannot hold a request longer.
The client ignores proxy environment variables, so what ``--image-hosts``
allows is what is reached.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ssl
import urllib.parse
from types import TracebackType

import httpx

from switchyard.media.errors import FETCH_FAILED, INVALID_URL, TOO_LARGE, ImageProblem
from switchyard.media.hosts import check_host
from switchyard.media.limits import ImageLimits

MAX_REDIRECTS = 3
"""Redirects one image fetch follows (each to a host ``--image-hosts`` allows)."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every fetch (building one reads the CA bundle: slow)."""
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


def _short(url: str) -> str:
    """``url`` cut for an error message (a data: URL can be megabytes)."""
    return url if len(url) <= 80 else url[:77] + "..."


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` URL.

    Base64 payloads may hold whitespace; others are percent-decoded. Raises
    :class:`ImageProblem` for a malformed URL or a payload over ``max_bytes``.
    """
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageProblem("a data: URL needs a comma before its data", INVALID_URL)
    if header.lower().endswith(";base64"):
        payload = "".join(payload.split())
        if len(payload) // 4 * 3 > max_bytes + 2:  # decoded size, from the encoded one
            raise ImageProblem(f"image of about {len(payload) // 4 * 3} bytes is over the "
                               f"limit of {max_bytes} bytes (--image-max-bytes)", TOO_LARGE)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageProblem("the data: URL's base64 payload is not valid base64",
                               INVALID_URL) from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise ImageProblem(f"image of {len(data)} bytes is over the limit of {max_bytes} bytes "
                           "(--image-max-bytes)", TOO_LARGE)
    if not data:
        raise ImageProblem("the data: URL holds no data", INVALID_URL)
    return data


class ImageFetcher:
    """Fetches the images of one request (``async with``); one HTTP client, made on first use."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> ImageFetcher:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def fetch(self, url: str) -> bytes:
        """The bytes ``url`` names; :class:`ImageProblem` for anything the client must fix."""
        scheme = url.partition(":")[0].lower()
        if scheme == "data":
            return decode_data_url(url, self.limits.max_bytes)
        if scheme not in _DEFAULT_PORTS:
            raise ImageProblem(f"image URL {_short(url)!r} is neither a data: nor an http(s) "
                               "URL", INVALID_URL)
        timeout = self.limits.timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._fetch_http(url)
        except TimeoutError:
            raise ImageProblem(f"fetching image {_short(url)!r} took longer than {timeout:g} s "
                               "(--image-fetch-timeout)", FETCH_FAILED) from None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False, trust_env=False, verify=_ssl_context(),
                timeout=self.limits.timeout_s, headers={"Accept": "image/*"})
        return self._client

    async def _fetch_http(self, url: str) -> bytes:
        limit = self.limits.max_bytes
        for _ in range(MAX_REDIRECTS + 1):
            try:
                parsed = httpx.URL(url)
            except (httpx.InvalidURL, ValueError) as exc:
                raise ImageProblem(f"invalid image URL {_short(url)!r}: {exc}",
                                   INVALID_URL) from None
            if parsed.scheme not in _DEFAULT_PORTS or not parsed.host:
                raise ImageProblem(f"invalid image URL {_short(url)!r}", INVALID_URL)
            await check_host(parsed.host, parsed.port or _DEFAULT_PORTS[parsed.scheme],
                             self.limits.hosts)
            try:
                async with self._http().stream("GET", parsed) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = str(parsed.join(response.headers["location"]))
                        continue
                    if response.status_code != 200:
                        raise ImageProblem(f"image URL {_short(url)!r} answered HTTP "
                                           f"{response.status_code}", FETCH_FAILED)
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise ImageProblem(f"image of {declared} bytes is over the limit of "
                                           f"{limit} bytes (--image-max-bytes)", TOO_LARGE)
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise ImageProblem(f"image is over the limit of {limit} bytes "
                                               "(--image-max-bytes)", TOO_LARGE)
                    return bytes(body)
            except httpx.TimeoutException:
                raise TimeoutError from None
            except httpx.HTTPError as exc:
                raise ImageProblem(f"cannot fetch image {_short(url)!r}: "
                                   f"{type(exc).__name__}: {exc}", FETCH_FAILED) from None
        raise ImageProblem(f"image URL {_short(url)!r} redirected more than {MAX_REDIRECTS} "
                           "times", FETCH_FAILED)
