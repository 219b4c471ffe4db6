"""Group info bytes (CBOR, never pickle) and backend selection by name."""

from __future__ import annotations

import subprocess
import sys

import cbor2
import pytest

from flodl.backends import choose_backend, open_backend, resolve_backend_name
from flodl.backends.gloo import GlooBackend
from flodl.backends.group import GroupInfo
from flodl.backends.nccl import NcclBackend, nccl_usable
from flodl.errors import BackendError, ConfigError
from flodl.wire.messages import NewGroupSession, from_payload, to_payload


def test_info_round_trips_canonically() -> None:
    info = GroupInfo(host="10.0.0.7", port=29500, prefix="flodl/gen3/abcd")
    data = info.encode()
    assert cbor2.loads(data) == {"host": "10.0.0.7", "port": 29500, "prefix": "flodl/gen3/abcd"}
    assert GroupInfo.decode(data) == info


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\x00garbage",
        cbor2.dumps([1, 2, 3]),
        cbor2.dumps({"host": "h", "port": 1}),
        cbor2.dumps({"host": "h", "port": 1, "prefix": "p", "extra": 0}),
        cbor2.dumps({"host": "", "port": 1, "prefix": "p"}),
        cbor2.dumps({"host": "h", "port": 0, "prefix": "p"}),
        cbor2.dumps({"host": "h", "port": 70000, "prefix": "p"}),
        cbor2.dumps({"host": "h", "port": "1", "prefix": "p"}),
        cbor2.dumps({"host": "h", "port": True, "prefix": "p"}),
        cbor2.dumps({"host": "h", "port": 1, "prefix": "p"}) + b"\x00",
        cbor2.dumps({"host": "h" * 2000, "port": 1, "prefix": "p"}),
    ],
)
def test_bad_info_is_rejected(data: bytes) -> None:
    with pytest.raises(BackendError):
        GroupInfo.decode(data)


@pytest.mark.skipif(nccl_usable(), reason="this host has NCCL and a GPU")
def test_auto_selects_gloo_without_cuda() -> None:
    assert resolve_backend_name("auto") == "gloo"
    assert open_backend("auto").name == "gloo"
    assert open_backend("gloo", op_timeout=5.0).name == "gloo"


@pytest.mark.parametrize(
    ("nccl", "gpus", "local_world_size", "chosen"),
    [
        (True, 2, 2, "nccl"),  # a GPU per rank
        (True, 8, 4, "nccl"),
        (True, 2, 4, "gloo"),  # more ranks than GPUs on the host: all of them take gloo
        (True, 0, 1, "gloo"),
        (False, 4, 2, "gloo"),  # GPUs, but no NCCL in this torch build
    ],
)
def test_auto_takes_nccl_only_with_a_gpu_for_every_rank_of_the_host(
    nccl: bool, gpus: int, local_world_size: int, chosen: str
) -> None:
    picked = choose_backend("auto", nccl=nccl, gpus=gpus, local_world_size=local_world_size)
    assert picked == chosen
    # An explicit name is taken as it is.
    assert choose_backend("gloo", nccl=True, gpus=8, local_world_size=1) == "gloo"
    assert choose_backend("nccl", nccl=False, gpus=0, local_world_size=1) == "nccl"


def test_unknown_name_and_unusable_nccl_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="unknown backend 'mpi'"):
        resolve_backend_name("mpi")
    if not nccl_usable():
        with pytest.raises(BackendError, match="needs a torch build with NCCL"):
            NcclBackend()


def test_importing_backends_does_not_import_torch() -> None:
    code = "import sys, flodl.backends, flodl.backends.base; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_prepared_info_travels_in_new_group_session() -> None:
    backend = GlooBackend()
    try:
        info = backend.prepare_group(4, "127.0.0.1")
        session = NewGroupSession(generation=4, new_rank=1, new_world_size=2, info=info)
        assert from_payload(NewGroupSession.TAG, to_payload(session)) == session
        parsed = GroupInfo.decode(info)
        assert parsed.host == "127.0.0.1" and parsed.prefix.startswith("flodl/gen4/")
        assert 0 < parsed.port < 65536
    finally:
        await backend.close()
