"""The variables torchrun gives each process, as ``flodl run`` gives them too.

A script written for ``torchrun`` (its own ``init_process_group`` over ``env://``, a DDP
model) runs under ``flodl run`` unchanged: it finds the layout where torchrun puts it, and a
``MASTER_ADDR``/``MASTER_PORT`` that is free for its own rendezvous store (flodl's coordinator
has an address of its own, ``FLODL_COORDINATOR``). Like torchrun, ``OMP_NUM_THREADS`` is set
to 1 for each of several ranks unless the user set it, so N ranks do not each start a thread
per core.
"""

from __future__ import annotations

import socket

import attrs

__all__ = ["OMP_NOTE", "TorchrunLayout", "free_port"]

OMP_NOTE = (
    "flodl: OMP_NUM_THREADS=1 for each rank (as torchrun does, so that {n} ranks do not each "
    "start a thread per core); set OMP_NUM_THREADS to choose another"
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS's choice). Another process
    may take it before the script binds it, as with torchrun's own choice."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


@attrs.frozen(kw_only=True)
class TorchrunLayout:
    """One process's place, in torchrun's terms: ``group`` is the node (agent) it runs on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int = 0
    group_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "none"

    def variables(self, environ: dict[str, str]) -> dict[str, str]:
        """The variables to set for this process (``OMP_NUM_THREADS`` only when ``environ``
        lacks it and the node runs several ranks)."""
        found = {
            "RANK": self.rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.local_world_size,
            "GROUP_RANK": self.group_rank,
            "GROUP_WORLD_SIZE": self.group_world_size,
            "ROLE_RANK": self.rank,
            "ROLE_WORLD_SIZE": self.world_size,
            "ROLE_NAME": "default",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
            "TORCHELASTIC_RESTART_COUNT": self.restart_count,
            "TORCHELASTIC_MAX_RESTARTS": self.max_restarts,
            "TORCHELASTIC_RUN_ID": self.run_id,
        }
        variables = {name: str(value) for name, value in found.items()}
        if "OMP_NUM_THREADS" not in environ and self.local_world_size > 1:
            variables["OMP_NUM_THREADS"] = "1"
        return variables
