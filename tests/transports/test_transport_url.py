"""Transport URL parsing: what is accepted, what it means, and what is refused with why."""

from __future__ import annotations

import pytest

from flodl.errors import TransportError, UnsupportedURL
from flodl.transports import parse_url
from flodl.transports.url import ParsedURL


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("tcp://127.0.0.1:0", ParsedURL(scheme="tcp", host="127.0.0.1", port=0)),
        ("tcp://10.1.2.3:29500", ParsedURL(scheme="tcp", host="10.1.2.3", port=29500)),
        (
            "TCP://node-7.cluster.local:65535",
            ParsedURL("tcp", host="node-7.cluster.local", port=65535),
        ),
        ("tcp://localhost:80", ParsedURL(scheme="tcp", host="localhost", port=80)),
        ("tcp://[::1]:9000", ParsedURL(scheme="tcp", host="::1", port=9000)),
        ("tcp://[fe80::1%eth0]:1", ParsedURL(scheme="tcp", host="fe80::1%eth0", port=1)),
        ("unix:///tmp/flodl.sock", ParsedURL(scheme="unix", path="/tmp/flodl.sock")),
        ("unix:///run/a b/c.sock", ParsedURL(scheme="unix", path="/run/a b/c.sock")),
        ("memory://coordinator", ParsedURL(scheme="memory", name="coordinator")),
        ("memory://sim.rank-1000_x~", ParsedURL(scheme="memory", name="sim.rank-1000_x~")),
    ],
)
def test_good_urls_parse_to_their_parts(url: str, expected: ParsedURL) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "tcp://127.0.0.1:0",
        "tcp://[::1]:9000",
        "unix:///tmp/flodl.sock",
        "memory://coordinator",
    ],
)
def test_canonical_text_round_trips(url: str) -> None:
    parsed = parse_url(url)
    assert parsed.url == url
    assert str(parsed) == url
    assert parse_url(parsed.url) == parsed


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("", "expected scheme://address"),
        ("127.0.0.1:5000", "expected scheme://address"),
        ("http://example.com:80", "unknown transport scheme 'http'"),
        ("udp://127.0.0.1:5", "unknown transport scheme 'udp'"),
        ("tcp://127.0.0.1", "missing ':port'"),
        ("tcp://:5000", "missing host"),
        ("tcp://127.0.0.1:", "port '' is not a number"),
        ("tcp://127.0.0.1:http", "port 'http' is not a number"),
        ("tcp://127.0.0.1:-1", "port '-1' is not a number"),
        ("tcp://127.0.0.1:65536", "port 65536 is above 65535"),
        ("tcp://127.0.0.1:5000/path", "nothing after the port"),
        ("tcp://user@127.0.0.1:5000", "nothing after the port"),
        ("tcp://127.0.0.1:5000?x=1", "nothing after the port"),
        ("tcp://::1:5000", "IPv6 address in brackets"),
        ("tcp://[::1:5000", "missing its closing ']'"),
        ("tcp://[not-ipv6]:5000", "is not an IPv6 address"),
        ("tcp://[::1]5000", "missing ':port' after the IPv6 address"),
        ("tcp://bad_host!:5000", "not a valid host name"),
        ("unix://relative/path.sock", "absolute path"),
        ("unix://", "absolute path"),
        ("unix:///tmp/dir/", "names a directory"),
        ("unix:///tmp/a\0b", "NUL byte"),
        ("unix:///" + "x" * 107, "above the 107-byte limit"),
        ("memory://", "missing name"),
        ("memory://a/b", "letters, digits"),
        ("memory://a b", "letters, digits"),
    ],
)
def test_bad_urls_are_refused_with_the_reason(url: str, complaint: str) -> None:
    with pytest.raises(UnsupportedURL) as caught:
        parse_url(url)
    assert complaint in str(caught.value)
    assert repr(url) in str(caught.value)


def test_unsupported_url_is_a_transport_error_and_a_value_error() -> None:
    with pytest.raises(TransportError):
        parse_url("ftp://x:1")
    with pytest.raises(ValueError):
        parse_url("ftp://x:1")


def test_a_non_string_is_refused() -> None:
    with pytest.raises(UnsupportedURL, match="must be a str, not bytes"):
        parse_url(b"tcp://127.0.0.1:0")  # type: ignore[arg-type]


def test_unix_path_of_exactly_107_bytes_is_accepted() -> None:
    path = "/" + "y" * 106
    assert parse_url("unix://" + path).path == path
