"""Group info: where a generation's rendezvous store lives, as opaque CBOR bytes.

The generator rank hosts a ``TCPStore`` for the generation (port chosen by the OS) and hands
out ``{"host", "port", "prefix"}``; every member connects to it and builds its process group
under that prefix. Never pickle: the bytes are CBOR and are checked field by field.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

import attrs
import cbor2
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from flodl.errors import BackendError

MAX_INFO_BYTES = 1024
_KEYS = frozenset({"host", "port", "prefix"})


@attrs.frozen
class GroupInfo:
    """The rendezvous address of one generation's group."""

    host: str
    port: int
    prefix: str

    def encode(self) -> bytes:
        """Canonical CBOR bytes of this info."""
        return bytes(cbor2.dumps({"host": self.host, "port": self.port, "prefix": self.prefix}))

    @staticmethod
    def decode(info: bytes) -> GroupInfo:
        """Parse info bytes; raises :class:`BackendError` on anything but a well-formed map."""
        if len(info) > MAX_INFO_BYTES:
            raise BackendError(f"group info is {len(info)} bytes, limit {MAX_INFO_BYTES}")
        try:
            value = cbor2.loads(info, max_depth=2, allow_indefinite=False)
        except Exception as err:  # cbor2 raises several unrelated types on garbage
            raise BackendError(f"group info is not valid CBOR: {err}") from None
        if type(value) is not dict or set(value) != _KEYS:
            raise BackendError(f"group info must be a map with keys {sorted(_KEYS)}")
        host, port, prefix = value["host"], value["port"], value["prefix"]
        if type(host) is not str or not host or type(prefix) is not str or not prefix:
            raise BackendError("group info: host and prefix must be non-empty strings")
        if type(port) is not int or not 0 < port < 65536:
            raise BackendError(f"group info: bad port {port!r}")
        decoded = GroupInfo(host=host, port=port, prefix=prefix)
        if decoded.encode() != bytes(info):
            raise BackendError("group info is not in canonical form (trailing or odd bytes)")
        return decoded


def host_store(generation: int, host: str) -> tuple[TCPStore, GroupInfo]:
    """Start the master store for ``generation`` on ``host`` (any free port).

    The caller keeps the returned store alive for the life of the generation's group (the
    process group built on it also holds a reference).
    """
    try:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as err:
        raise BackendError(f"cannot host the group store on {host!r}: {err}") from err
    prefix = f"flodl/gen{generation}/{secrets.token_hex(4)}"
    return store, GroupInfo(host=host, port=store.port, prefix=prefix)


def connect_store(info: GroupInfo, timeout: timedelta) -> Store:
    """A client of the generation's store, scoped to its prefix (blocks up to ``timeout``)."""
    try:
        client = TCPStore(info.host, info.port, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as err:
        raise BackendError(f"cannot reach the group store {info.host}:{info.port}: {err}") from err
    return PrefixStore(info.prefix, client)
