"""The package imports light: no torch at `import flodl`, nor in the processes that only
coordinate and supervise (`flodl run`, `flodl coordinator`, `flodl agent`), nor in `flodl worker`
before it hands over to the script."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "modules",
    [
        "flodl, flodl.wire.messages",
        # The `flodl` command and what its commands import: a launcher that imported torch
        # would spend a second or more starting for nothing, and `flodl worker` would import
        # it twice (once more in the script it becomes).
        "flodl.cli, flodl.launch.launcher, flodl.agent.agent, flodl.coordinator.server",
        "flodl.worker, flodl.worker.command",
    ],
)
def test_import_does_not_import_torch(modules: str) -> None:
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
