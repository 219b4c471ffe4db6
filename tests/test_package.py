"""The package imports light: no torch at `import flodl`."""

import subprocess
import sys


def test_import_flodl_does_not_import_torch() -> None:
    code = "import sys, flodl, flodl.wire.messages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
