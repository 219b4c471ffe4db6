"""Transport URLs: ``tcp://host:port``, ``unix:///abs/path``, ``memory://name``.

:func:`parse_url` turns the text into a :class:`ParsedURL` or raises
:class:`~flodl.errors.UnsupportedURL` saying what is wrong. It checks syntax only: it neither
resolves host names nor touches the file system.
"""

from __future__ import annotations

import ipaddress
import os
import re

import attrs

from flodl.errors import UnsupportedURL

KNOWN_SCHEMES = ("tcp", "unix", "memory")

# sun_path holds 108 bytes on Linux, including the terminating NUL.
UNIX_PATH_MAX_BYTES = 107

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_MEMORY_NAME = re.compile(r"[A-Za-z0-9._~-]+")
_EXAMPLES = "e.g. tcp://127.0.0.1:0, unix:///run/flodl.sock or memory://coordinator"


@attrs.frozen
class ParsedURL:
    """A syntactically valid transport address.

    Only the fields of its scheme are set: ``host`` and ``port`` for tcp (``host`` without
    IPv6 brackets; port 0 means "pick a free port" when listening), ``path`` for unix (an
    absolute path), ``name`` for memory.
    """

    scheme: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    name: str | None = None

    @property
    def url(self) -> str:
        """The canonical text of this address (parses back to an equal ParsedURL)."""
        if self.scheme == "tcp":
            assert self.host is not None and self.port is not None
            return format_tcp_url(self.host, self.port)
        if self.scheme == "unix":
            return f"unix://{self.path}"
        return f"memory://{self.name}"

    def __str__(self) -> str:
        return self.url


def format_tcp_url(host: str, port: int) -> str:
    """``tcp://host:port``, with an IPv6 literal put in brackets."""
    if ":" in host:
        return f"tcp://[{host}]:{port}"
    return f"tcp://{host}:{port}"


def parse_url(url: str) -> ParsedURL:
    """Parse a transport URL; raise UnsupportedURL naming the URL and the problem."""
    if not isinstance(url, str):
        raise UnsupportedURL(f"a transport URL must be a str, not {type(url).__name__}")
    scheme, separator, rest = url.partition("://")
    if not separator:
        raise UnsupportedURL(
            f"{url!r} is not a transport URL: expected scheme://address, {_EXAMPLES}"
        )
    scheme = scheme.lower()
    if scheme == "tcp":
        return _parse_tcp(url, rest)
    if scheme == "unix":
        return _parse_unix(url, rest)
    if scheme == "memory":
        return _parse_memory(url, rest)
    known = ", ".join(f"{s}://" for s in KNOWN_SCHEMES)
    raise UnsupportedURL(f"{url!r}: unknown transport scheme {scheme!r} (known: {known})")


def _parse_tcp(url: str, rest: str) -> ParsedURL:
    for forbidden in "/?#@":
        if forbidden in rest:
            raise UnsupportedURL(
                f"{url!r}: a tcp URL is tcp://host:port with nothing after the port "
                f"(found {forbidden!r})"
            )
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise UnsupportedURL(f"{url!r}: IPv6 address is missing its closing ']'")
        host, after = rest[1:close], rest[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UnsupportedURL(f"{url!r}: {host!r} is not an IPv6 address") from None
        if not after.startswith(":"):
            raise UnsupportedURL(f"{url!r}: missing ':port' after the IPv6 address")
        port_text = after[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise UnsupportedURL(f"{url!r}: missing ':port' (use port 0 to pick a free one)")
        if not host:
            raise UnsupportedURL(f"{url!r}: missing host (e.g. 127.0.0.1 or 0.0.0.0)")
        if ":" in host:
            raise UnsupportedURL(f"{url!r}: write an IPv6 address in brackets, tcp://[::1]:port")
        if not _HOSTNAME.fullmatch(host):
            raise UnsupportedURL(f"{url!r}: {host!r} is not a valid host name or address")
    if not port_text.isdigit() or not port_text.isascii():
        raise UnsupportedURL(f"{url!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise UnsupportedURL(f"{url!r}: port {port} is above 65535")
    return ParsedURL(scheme="tcp", host=host, port=port)


def _parse_unix(url: str, path: str) -> ParsedURL:
    if not path.startswith("/"):
        raise UnsupportedURL(
            f"{url!r}: a unix URL takes an absolute path after 'unix://', "
            "e.g. unix:///run/flodl.sock (three slashes)"
        )
    if "\0" in path:
        raise UnsupportedURL(f"{url!r}: the socket path contains a NUL byte")
    if path.endswith("/"):
        raise UnsupportedURL(f"{url!r}: the socket path names a directory, not a file")
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX_BYTES:
        raise UnsupportedURL(
            f"{url!r}: the socket path is {size} bytes, above the "
            f"{UNIX_PATH_MAX_BYTES}-byte limit of unix sockets"
        )
    return ParsedURL(scheme="unix", path=path)


def _parse_memory(url: str, name: str) -> ParsedURL:
    if not name:
        raise UnsupportedURL(f"{url!r}: missing name, e.g. memory://coordinator")
    if not _MEMORY_NAME.fullmatch(name):
        raise UnsupportedURL(
            f"{url!r}: a memory name uses only letters, digits and '._~-', found {name!r}"
        )
    return ParsedURL(scheme="memory", name=name)
