"""Which hosts the gateway may fetch images from (``--image-hosts``).

A server that fetches whatever URL a client names is a way into the network
behind it (server-side request forgery): metadata services, admin consoles,
databases on private addresses. So http(s) fetching is off unless the
operator lists hosts, comma-separated:

- ``images.example.com``: that host name exactly (any port);
- ``*.example.com``: any subdomain of ``example.com`` (not ``example.com`` itself);
- ``203.0.113.7``, ``::1``: that address, written as an IP literal in the URL;
- ``*``: any host whose addresses are all public (globally routable): a host
  name is resolved first, and one that resolves to a loopback, private,
  link-local or otherwise reserved address is refused unless it is listed by
  name. (The HTTP client resolves the name again when it connects; a DNS
  server that answers differently the second time is not defended against
  here, so list hosts by name where that matters, or fetch through an egress
  proxy.)

Listed names and addresses are trusted as written, loopback and private ones
included: that is how a test or an intranet deployment allows its own server.
Redirects are followed only to hosts the list allows too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from switchyard.media.errors import FETCH_FAILED, HOST_NOT_ALLOWED, ImageProblem

ANY_PUBLIC = "*"
"""The entry that allows every host with only public addresses."""

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _normal(host: str) -> str:
    return host.strip().lower().rstrip(".")


def listed(host: str, entries: tuple[str, ...]) -> bool:
    """Whether ``host`` is allowed by name or address (``*`` aside)."""
    host = _normal(host)
    ip = _ip(host)
    for entry in entries:
        entry = _normal(entry)
        if entry == ANY_PUBLIC:
            continue
        if ip is not None:
            if _ip(entry) == ip:
                return True
        elif entry.startswith("*."):
            if host.endswith(entry[1:]):
                return True
        elif entry == host:
            return True
    return False


def is_public(ip: IpAddress) -> bool:
    """Whether ``ip`` is globally routable (not loopback, private, link-local, reserved...)."""
    return ip.is_global and not ip.is_multicast


async def check_host(host: str, port: int, entries: tuple[str, ...]) -> None:
    """Raise :class:`ImageProblem` unless ``entries`` allow fetching from ``host``.

    A host allowed only by ``*`` is resolved here, and every address it has
    must be public.
    """
    if not entries:
        raise ImageProblem(
            f"fetching images over http(s) is disabled on this server (host {host!r}); send the "
            "image as a data: URL, or start the server with --image-hosts", HOST_NOT_ALLOWED)
    if listed(host, entries):
        return
    if ANY_PUBLIC not in entries:
        raise ImageProblem(f"host {host!r} is not in this server's --image-hosts",
                           HOST_NOT_ALLOWED)
    ip = _ip(host)
    if ip is not None:
        addresses = [ip]
    else:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ImageProblem(f"cannot resolve image host {host!r}: {exc}",
                               FETCH_FAILED) from None
        addresses = [a for a in (_ip(str(info[4][0])) for info in infos) if a is not None]
    private = [str(a) for a in addresses if not is_public(a)]
    if private or not addresses:
        raise ImageProblem(
            f"image host {host!r} has a non-public address ({', '.join(private) or 'none'}); "
            "--image-hosts '*' allows public hosts only: list the host by name to allow it",
            HOST_NOT_ALLOWED)
