"""examples/wire_demo.py runs end to end in a subprocess and reports success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "wire_demo.py"


def test_wire_demo_runs_and_rejects_the_impostor() -> None:
    done = subprocess.run(
        [sys.executable, str(DEMO), "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "OK"
    assert any(line.startswith("impostor with a wrong key: rejected (WrongKey") for line in lines)
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert all(int(row[1]) > 0 and int(row[2]) > int(row[1]) for row in rows)  # batches + more
