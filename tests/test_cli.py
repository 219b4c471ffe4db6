"""`flodl run` / `flodl coordinator` / `flodl worker` refuse bad input before any rank starts.

Every refusal is exit status 2 with one line naming the flag the user typed; none of these
tests starts a rank (a refused worker never execs its script).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flodl.backends import check_backend_on_host
from flodl.cli import main
from flodl.errors import ConfigError

KEY = "ab" * 32


@pytest.fixture
def script(tmp_path: Path) -> Path:
    """A script that leaves a mark if anything ever runs it."""
    path = tmp_path / "train.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc", "0"], "--nproc must be an integer >= 1, got 0"),
        (["--restarts", "-1"], "--restarts must be an integer >= 0, got -1"),
        (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
        (["--heartbeat-timeout", "-1"], "--heartbeat-timeout must be a number of seconds > 0"),
        (["--heartbeat-timeout", "inf"], "--heartbeat-timeout must be a number of seconds > 0"),
        (["--stall-ceiling", "0"], "--stall-ceiling must be a number of seconds > 0"),
        (["--anchor", "0"], "--anchor must be an integer >= 1"),
        (["--max-batch-diff", "-2"], "--max-batch-diff must be an integer >= 0"),
        (["--window-cap-epochs", "0"], "--window-cap-epochs must be a number > 0"),
        (["--relax-up", "--policy", "sync"], "--relax-up grows cadence windows"),
        (["--nproc", "many"], "--nproc must be a number, auto, gpu or cpu, got 'many'"),
        (["--nproc", "gpu"], "--nproc gpu: torch sees no usable GPU on this host"),
        (["--show-ranks", "0,x"], "--show-ranks must list ranks like 0,2 or 0-3, got '0,x'"),
        (["--nnodes", "2"], "--nnodes needs --coordinator HOST:PORT, where node 0 serves it"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1"],
            "--node-rank must be below --nnodes (2), got 2",
        ),
        (["--nnodes", "0"], "--nnodes must be an integer >= 1, got 0"),
        (
            ["--nnodes", "2", "--coordinator", "unix:///x"],
            "--coordinator must be HOST:PORT (an address of node 0)",
        ),
        (["--outer-lr", "-0.5"], "--outer-lr must be a number > 0, got -0.5"),
        (["--outer-lr", "nan"], "--outer-lr must be a number > 0, got nan"),
        (["--outer-momentum", "1"], "--outer-momentum must be a number in [0, 1), got 1.0"),
        (["--outer-momentum", "-0.1"], "--outer-momentum must be a number in [0, 1), got -0.1"),
        (["--outer", "adam"], "--outer must be one of none, sgd, nesterov, got 'adam'"),
        (
            ["--outer-momentum", "0.5"],
            "--outer-momentum must be 0 with --outer sgd (nesterov takes a momentum), got 0.5",
        ),
        (
            ["--average-dtype", "int8"],
            "--average-dtype must be one of fp32, bf16, fp16, got 'int8'",
        ),
        (
            ["--average-dtype", "bf16", "--policy", "async"],
            "--average-dtype bf16 needs --policy sync or cadence",
        ),
    ],
)
def test_run_refuses_a_bad_flag_by_its_name(
    tmp_path: Path,
    script: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    run_dir = tmp_path / "run"
    argv = ["run", "--nproc", "2", "--run-dir", str(run_dir), *flags, str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"flodl: error: {message}" in err, err
    assert not (tmp_path / "ran").exists() and not run_dir.exists()


def test_run_refuses_a_directory_as_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--nproc", "1", "--run-dir", str(tmp_path / "run"), str(tmp_path)]) == 2
    assert f"script {str(tmp_path)!r} is not a file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_missing_script_exits_2_before_any_rank_starts(tmp_path: Path) -> None:
    missing = tmp_path / "missing.py"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl.cli",
            "run",
            "--nproc",
            "3",
            "--run-dir",
            str(tmp_path / "r"),
            str(missing),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"flodl: error: script {str(missing)!r} does not exist"
    assert "[rank" not in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()


def test_nccl_is_refused_on_a_host_without_a_gpu_per_rank(
    tmp_path: Path, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_backend_on_host("nccl", 1)
    with pytest.raises(ConfigError, match=r"--backend nccl needs a CUDA GPU for each of the 2"):
        check_backend_on_host("nccl", 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError, match=r"--backend nccl: this torch build .* has no NCCL"):
        check_backend_on_host("nccl", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    argv = [
        "run",
        "--nproc",
        "2",
        "--backend",
        "nccl",
        "--run-dir",
        str(tmp_path / "r"),
        str(script),
    ]
    assert main(argv) == 2
    assert not (tmp_path / "ran").exists() and not (tmp_path / "r").exists()


def test_bf16_rounds_are_refused_on_gpus_whose_nccl_cannot_reduce_them(
    tmp_path: Path,
    script: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch
    import torch.distributed

    # No GPU here: torch is told of two, the second a pre-Ampere one (compute capability 7.5).
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(8, 0), (7, 5)][i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: ["A100", "T4"][i])
    check_backend_on_host("nccl", 1, "bf16")  # GPU 0 alone reduces bf16
    check_backend_on_host("nccl", 2, "fp16")
    check_backend_on_host("gloo", 2, "bf16")
    with pytest.raises(ConfigError, match=r"--average-dtype bf16: GPU 1 \(T4, compute capab"):
        check_backend_on_host("nccl", 2, "bf16")
    with pytest.raises(ConfigError, match=r"--average-dtype bf16: GPU 1"):
        check_backend_on_host("auto", 2, "bf16")  # auto takes nccl with a GPU per rank
    run_dir = tmp_path / "r"
    flags = ["--nproc", "2", "--backend", "nccl", "--average-dtype", "bf16"]
    assert main(["run", *flags, "--run-dir", str(run_dir), str(script)]) == 2
    assert "flodl: error: --average-dtype bf16: GPU 1 (T4" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists() and not run_dir.exists()


def test_gloo_and_auto_are_checked_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from flodl.backends import check_backend_on_host\n"
        "check_backend_on_host('gloo', 64); check_backend_on_host('auto', 64)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator", "nowhere"], "--coordinator: 'nowhere' is not a transport URL"),
        (["--world-size", "0"], "--world-size must be an integer >= 1, got 0"),
        (["--rank", "-1"], "--rank must be an integer >= 0, got -1"),
        (["--rank", "2"], "--rank must be below --world-size (2), got 2"),
        (["--heartbeat-timeout", "-1"], "--heartbeat-timeout must be a number of seconds > 0"),
        (["--host", " "], "--host must not be empty"),
    ],
)
def test_worker_refuses_a_bad_flag_by_its_name(
    tmp_path: Path,
    script: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("FLODL_SESSION_KEY", KEY)
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    defaults = {"--coordinator": "tcp://127.0.0.1:9", "--rank": "0", "--world-size": "2"}
    argv = ["worker", *(x for item in {**defaults, **given}.items() for x in item)]
    assert main([*argv, "--run-dir", str(tmp_path / "r"), str(script)]) == 2
    assert f"flodl: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "r").exists()


def test_worker_refuses_a_missing_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLODL_SESSION_KEY", KEY)
    started: list[object] = []
    monkeypatch.setattr("os.execvpe", lambda *a: started.append(a))
    argv = ["worker", "--coordinator", "tcp://127.0.0.1:9", "--rank", "0", "--world-size", "1"]
    missing = tmp_path / "x.py"
    assert main([*argv, "--run-dir", str(tmp_path / "r"), str(missing)]) == 2
    assert f"script {str(missing)!r} does not exist" in capsys.readouterr().err
    assert started == [] and not (tmp_path / "r").exists()


def test_worker_takes_the_coordinators_heartbeat_interval(
    tmp_path: Path, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 0.5 s timeout is valid for `flodl coordinator`; the worker beacons every 0.125 s.
    monkeypatch.setenv("FLODL_SESSION_KEY", KEY)
    started: list[dict[str, str]] = []
    monkeypatch.setattr("os.execvpe", lambda _f, _a, env: started.append(env))
    argv = ["worker", "--coordinator", "tcp://127.0.0.1:9", "--rank", "0", "--world-size", "1"]
    main([*argv, "--heartbeat-timeout", "0.5", "--run-dir", str(tmp_path / "r"), str(script)])
    (env,) = started
    assert (env["FLODL_HEARTBEAT_TIMEOUT"], env["FLODL_HEARTBEAT_INTERVAL"]) == ("0.5", "0.125")


def test_coordinator_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["coordinator", "--listen", "tcp://127.0.0.1:0", "--world-size", "0"]
    assert main(argv) == 2
    assert "--world-size must be an integer >= 1, got 0" in capsys.readouterr().err
    argv = ["coordinator", "--listen", "tcp://127.0.0.1:0", "--world-size", "2"]
    assert main([*argv, "--heartbeat-timeout", "-1"]) == 2
    assert "--heartbeat-timeout must be a number of seconds > 0" in capsys.readouterr().err


def test_a_dashboard_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    import socket

    digits = Path(__file__).parents[1] / "examples" / "digits.py"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "2", "--no-live"]
        command += ["--run-dir", str(tmp_path / "run"), "--dashboard", f"127.0.0.1:{port}"]
        done = subprocess.run(
            [*command, str(digits)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"flodl: error: --dashboard 127.0.0.1:{port}: cannot listen there: "
        "[Errno 98] Address already in use"
    ]


def test_nproc_reads_as_torchruns_nproc_per_node() -> None:
    import os

    import torch

    from flodl.host.layout import nproc_of, ranks_of

    assert nproc_of("3") == 3
    assert nproc_of("cpu") == os.cpu_count()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert nproc_of("auto") == (gpus or os.cpu_count())
    assert ranks_of("--show-ranks", "0,2-4") == frozenset({0, 2, 3, 4})
    assert ranks_of("--show-ranks", None) is None


def test_show_ranks_relays_only_those_ranks_and_logs_all(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    command = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "3", "--no-live"]
    command += ["--run-dir", str(tmp_path / "run"), "--show-ranks", "1", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 1] hello from 1" in done.stdout
    assert "hello from 0" not in done.stdout and "hello from 2" not in done.stdout
    for rank in range(3):
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        assert f"hello from {rank}" in log


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--nproc", "2"],
        ["worker", "--coordinator", "tcp://127.0.0.1:1", "--rank", "0", "--world-size", "2"],
    ],
)
def test_a_scripts_options_are_never_taken_for_abbreviations_of_ours(command: list[str]) -> None:
    from flodl.cli import build_parser

    # --out and --check would otherwise read as ambiguous abbreviations of --outer* and
    # --checkpoint-*, and --max-t as --max-time.
    script_args = ["--out=results", "--check", "--max-t", "3"]
    args = build_parser().parse_args([*command, "train.py", *script_args])
    assert (args.script, args.script_args) == ("train.py", script_args)
