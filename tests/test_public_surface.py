"""The public surface of flodl, pinned by literal values, so that moving or renaming a public
name fails here and not in a user's script.

It guarantees, against values written out below (never computed from the code):

* ``flodl.__all__``, ``flodl.worker.__all__``, ``flodl.checkpoint.__all__`` and the names of
  ``flodl.testing`` that docs/testing.md documents, each importable;
* every ``from flodl.X import Y`` and every dotted ``flodl.X.Y`` that README.md, docs/ and
  examples/ show still works;
* the ``flodl`` command's subcommands, each one's flags and positionals (read from the parser);
* the environment variables flodl reads or writes (found by scanning every file of the
  package, wherever it lives, and compared to the pinned set);
* the wire tag of every message class and the values of the enums that travel on the wire;
* the names of the files in a run folder and in a checkpoint bundle, and the meta's keys,
  through a real save into a temporary folder.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

import flodl
import flodl.checkpoint
import flodl.testing
import flodl.worker

# --- the package's exported names -------------------------------------------------------------

FLODL_ALL = [
    "CoordinatorConfig",
    "FlodlError",
    "GuardKind",
    "MaxFailure",
    "Policy",
    "RunAborted",
    "SaveReason",
    "ShutdownRequested",
    "__version__",
]

WORKER_ALL = [
    "Assignment",
    "Rank",
    "TrainingBatch",
    "Worker",
    "WorkerConfig",
    "join",
    "open_worker",
]

CHECKPOINT_ALL = [
    "Bundle",
    "CheckpointMeta",
    "DeathRecord",
    "SCHEMA_VERSION",
    "default_stem",
    "elche_for_world",
    "find_latest",
    "load_bundle",
    "read_death_records",
    "save_bundle",
    "write_death_record",
]

# flodl.testing has no __all__: these are the public names it defines (docs/testing.md).
TESTING_NAMES = [
    "Cluster",
    "RankRecord",
    "RankScript",
    "ScriptedRank",
    "SimulatedGroup",
    "SimulatedGroups",
    "TEST_KEY",
    "open_cluster",
]

# The RankScript fields docs/testing.md lists.
RANK_SCRIPT_DOCUMENTED_FIELDS = [
    "collective_ms",
    "data_ms",
    "die_after_batches",
    "die_on_group_request",
    "fail_joins",
    "hang_collectives",
    "heartbeat_interval",
    "ignore_group_requests",
    "join_ms",
    "ms_per_batch",
    "silent_after_batches",
    "skip_completion_frames",
]


def _difference(actual: object, expected: list[str]) -> dict[str, list[str]]:
    """What is missing from ``actual`` and what it holds that is not expected, for a clear
    failure message."""
    assert isinstance(actual, list | tuple | set | frozenset | dict)
    names = {str(name) for name in actual}
    return {"missing": sorted(set(expected) - names), "unexpected": sorted(names - set(expected))}


NOTHING: dict[str, list[str]] = {"missing": [], "unexpected": []}


def test_flodl_all() -> None:
    assert _difference(flodl.__all__, FLODL_ALL) == NOTHING
    assert len(flodl.__all__) == len(FLODL_ALL)


@pytest.mark.parametrize("name", FLODL_ALL)
def test_flodl_all_name_is_an_attribute(name: str) -> None:
    assert hasattr(flodl, name)


def test_flodl_version() -> None:
    assert flodl.__version__ == "0.1.0"


def test_worker_all() -> None:
    assert _difference(flodl.worker.__all__, WORKER_ALL) == NOTHING
    assert len(flodl.worker.__all__) == len(WORKER_ALL)


@pytest.mark.parametrize("name", WORKER_ALL)
def test_worker_name_imports(name: str) -> None:
    assert hasattr(importlib.import_module("flodl.worker"), name)


def test_checkpoint_all() -> None:
    assert _difference(flodl.checkpoint.__all__, CHECKPOINT_ALL) == NOTHING
    assert len(flodl.checkpoint.__all__) == len(CHECKPOINT_ALL)


@pytest.mark.parametrize("name", CHECKPOINT_ALL)
def test_checkpoint_name_imports(name: str) -> None:
    assert hasattr(importlib.import_module("flodl.checkpoint"), name)


@pytest.mark.parametrize("name", TESTING_NAMES)
def test_testing_name_imports(name: str) -> None:
    assert hasattr(importlib.import_module("flodl.testing"), name)


def test_testing_all_if_any() -> None:
    """Should flodl.testing gain an ``__all__``, it must hold at least the documented names."""
    exported = getattr(flodl.testing, "__all__", None)
    if exported is not None:
        assert set(TESTING_NAMES) <= set(exported)


def test_rank_script_documented_fields() -> None:
    import attrs

    fields = {field.name for field in attrs.fields(flodl.testing.RankScript)}
    missing = sorted(set(RANK_SCRIPT_DOCUMENTED_FIELDS) - fields)
    assert missing == []


def test_cluster_documented_attributes() -> None:
    import attrs

    assert {f.name for f in attrs.fields(flodl.testing.Cluster)} >= {
        "coordinator",
        "ranks",
        "started_at",
    }


# --- what the docs, the README and the examples import ------------------------------------------

# Every `from flodl.X import Y` in README.md, docs/*.md and examples/*.py, plus the
# open_coordinator that flodl.testing and docs/architecture.md build on.
DOCUMENTED_IMPORTS = [
    ("flodl.coordinator.admission", "serve_ranks"),
    ("flodl.coordinator", "open_coordinator"),
    ("flodl.errors", "ConfigError"),
    ("flodl.errors", "CoordinatorError"),
    ("flodl.errors", "FlodlError"),
    ("flodl.errors", "HandshakeError"),
    ("flodl.errors", "RunAborted"),
    ("flodl.errors", "ShutdownRequested"),
    ("flodl.errors", "WrongKey"),
    ("flodl.testing", "RankScript"),
    ("flodl.testing", "open_cluster"),
    ("flodl.transports", "connect"),
    ("flodl.transports", "open_listener"),
    ("flodl.transports.channel", "Channel"),
    ("flodl.transports.greeting", "connect_rank"),
    ("flodl.transports.greeting", "connect_agent"),
    ("flodl.wire.messages", "Batch"),
    ("flodl.wire.messages", "CoordHeartbeat"),
    ("flodl.wire.messages", "Exiting"),
    ("flodl.wire.messages", "Heartbeat"),
    ("flodl.wire.messages", "Message"),
    ("flodl.wire.messages", "SaveReason"),
    ("flodl.wire.messages", "SyncAck"),
    ("flodl.wire.messages", "SyncNow"),
    ("flodl.worker", "WorkerConfig"),
    ("flodl.worker", "open_worker"),
]

# Every dotted `flodl.X.Y` (a module, then a name in it) that README.md and docs/*.md name.
DOCUMENTED_DOTTED = [
    ("flodl.backends", "Backend"),
    ("flodl.averaging.kernels", "warm_up"),
    ("flodl.checkpoint", "CheckpointMeta"),
    ("flodl.checkpoint", "elche_for_world"),
    ("flodl.checkpoint", "find_latest"),
    ("flodl.checkpoint", "load_bundle"),
    ("flodl.checkpoint", "save_bundle"),
    ("flodl.checkpoint", "write_death_record"),
    ("flodl.checkpoint.prune", "prune_bundles"),
    ("flodl.checkpoint.resume", "plan_resume"),
    ("flodl.config", "CoordinatorConfig"),
    ("flodl.core.coordinator.machine", "CoordinatorMachine"),
    ("flodl.core.rank.machine", "RankMachine"),
    ("flodl.errors", "FlodlError"),
    ("flodl.launch.launcher", "launch"),
    ("flodl.observe.events", "read_events"),
    ("flodl.testing", "ScriptedRank"),
    ("flodl.testing", "SimulatedGroup"),
    ("flodl.testing", "open_cluster"),
    ("flodl.worker", "join"),
    ("flodl.worker.saving", "BundleSaver"),
]

DOCUMENTED_MODULES = ["flodl.checkpoint", "flodl.testing", "flodl.wire.messages", "flodl.worker"]


@pytest.mark.parametrize(("module", "name"), DOCUMENTED_IMPORTS)
def test_documented_import(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"


@pytest.mark.parametrize(("module", "name"), DOCUMENTED_DOTTED)
def test_documented_dotted_name(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_documented_module(module: str) -> None:
    importlib.import_module(module)


def test_bundle_saver_save_on_loss() -> None:
    from flodl.worker.saving import BundleSaver

    assert callable(BundleSaver.save_on_loss)  # docs/checkpoints.md names it


# --- the flodl command ---------------------------------------------------------------------------

TOP_LEVEL_FLAGS = ["--help", "-h"]

CLI_FLAGS = {
    "agent": [
        "--cold-start",
        "--coordinator",
        "--help",
        "--host",
        "--join-timeout",
        "--master-addr",
        "--master-port",
        "--node-rank",
        "--nproc",
        "--quiet",
        "--restarts",
        "--run-dir",
        "--show-ranks",
        "--strict",
        "-h",
    ],
    "coordinator": [
        "--anchor",
        "--average-dtype",
        "--backend",
        "--checkpoint-every",
        "--checkpoint-every-epochs",
        "--dashboard",
        "--dashboard-token-file",
        "--heartbeat-timeout",
        "--help",
        "--join-timeout",
        "--keep-checkpoints",
        "--listen",
        "--max-anchor",
        "--max-batch-diff",
        "--max-time",
        "--min-ranks",
        "--no-live",
        "--outer",
        "--outer-lr",
        "--outer-momentum",
        "--policy",
        "--quiet",
        "--relax-up",
        "--report",
        "--run-dir",
        "--seed",
        "--stall-ceiling",
        "--strict",
        "--window-cap-epochs",
        "--window-cap-s",
        "--world-size",
        "-h",
    ],
    "report": ["--help", "--tensorboard", "-h"],
    "run": [
        "--anchor",
        "--average-dtype",
        "--backend",
        "--checkpoint-every",
        "--checkpoint-every-epochs",
        "--cold-start",
        "--coordinator",
        "--dashboard",
        "--dashboard-token-file",
        "--heartbeat-timeout",
        "--help",
        "--join-timeout",
        "--keep-checkpoints",
        "--max-anchor",
        "--max-batch-diff",
        "--max-time",
        "--min-ranks",
        "--nnodes",
        "--no-live",
        "--node-rank",
        "--nproc",
        "--outer",
        "--outer-lr",
        "--outer-momentum",
        "--overwrite",
        "--policy",
        "--quiet",
        "--relax-up",
        "--report",
        "--restarts",
        "--resume",
        "--run-dir",
        "--seed",
        "--show-ranks",
        "--stall-ceiling",
        "--strict",
        "--transport",
        "--window-cap-epochs",
        "--window-cap-s",
        "-h",
    ],
    "warm-helper": ["--help", "-h"],
    "worker": [
        "--backend",
        "--coordinator",
        "--heartbeat-timeout",
        "--help",
        "--host",
        "--join-timeout",
        "--local-rank",
        "--local-world-size",
        "--master-addr",
        "--master-port",
        "--policy",
        "--rank",
        "--run-dir",
        "--world-size",
        "-h",
    ],
}

CLI_POSITIONALS = {
    "agent": ["script", "script_args"],
    "coordinator": [],
    "report": ["run_dir"],
    "run": ["script", "script_args"],
    "warm-helper": ["socket"],
    "worker": ["script", "script_args"],
}


def _parser() -> argparse.ArgumentParser:
    from flodl.cli import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the flodl parser has no subcommands")


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings)


def _positionals(parser: argparse.ArgumentParser) -> list[str]:
    return [
        action.dest
        for action in parser._actions
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction)
    ]


def test_cli_entry_point() -> None:
    from flodl.cli import main

    assert callable(main)  # pyproject.toml: flodl = "flodl.cli:main"


def test_cli_top_level_flags() -> None:
    assert _difference(_flags(_parser()), TOP_LEVEL_FLAGS) == NOTHING


def test_cli_subcommands() -> None:
    assert _difference(_subparsers(_parser()), sorted(CLI_FLAGS)) == NOTHING


@pytest.mark.parametrize("command", sorted(CLI_FLAGS))
def test_cli_flags(command: str) -> None:
    flags = _flags(_subparsers(_parser())[command])
    assert _difference(flags, CLI_FLAGS[command]) == NOTHING
    assert flags == CLI_FLAGS[command]


@pytest.mark.parametrize("command", sorted(CLI_POSITIONALS))
def test_cli_positionals(command: str) -> None:
    assert _positionals(_subparsers(_parser())[command]) == CLI_POSITIONALS[command]


# --- environment variables -----------------------------------------------------------------------

ENV_VARS = {
    "FLODL_BACKEND",
    "FLODL_COORDINATOR",
    "FLODL_DEBUG_PARAM_HASHES",
    "FLODL_HEARTBEAT_INTERVAL",
    "FLODL_HEARTBEAT_TIMEOUT",
    "FLODL_HOST",
    "FLODL_JOIN_TIMEOUT",
    "FLODL_KEEP_CHECKPOINTS",
    "FLODL_OP_TIMEOUT",
    "FLODL_POLICY",
    "FLODL_RESUME",
    "FLODL_RUN_DIR",
    "FLODL_SEED",
    "FLODL_SESSION_KEY",
    "FLODL_SESSION_KEY_FILE",
    "FLODL_STOP_ON_SIGNALS",
    "FLODL_WARM_HELPER",
    "FLODL_ZYGOTE_FD",
    "GLOO_SOCKET_IFNAME",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "RANK",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_TASKS_PER_NODE",
    "TERM",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "WORLD_SIZE",
}

# flodl.host.environment's names for the variables a rank is started with (its public constants).
ENVIRONMENT_CONSTANTS = {
    "BACKEND": "FLODL_BACKEND",
    "COORDINATOR": "FLODL_COORDINATOR",
    "DEBUG_PARAM_HASHES": "FLODL_DEBUG_PARAM_HASHES",
    "HEARTBEAT_INTERVAL": "FLODL_HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT": "FLODL_HEARTBEAT_TIMEOUT",
    "HOST": "FLODL_HOST",
    "JOIN_TIMEOUT": "FLODL_JOIN_TIMEOUT",
    "KEEP_CHECKPOINTS": "FLODL_KEEP_CHECKPOINTS",
    "LOCAL_RANK": "LOCAL_RANK",
    "LOCAL_WORLD_SIZE": "LOCAL_WORLD_SIZE",
    "MASTER_ADDR": "MASTER_ADDR",
    "MASTER_PORT": "MASTER_PORT",
    "OP_TIMEOUT": "FLODL_OP_TIMEOUT",
    "POLICY": "FLODL_POLICY",
    "RANK": "RANK",
    "RESUME": "FLODL_RESUME",
    "RUN_DIR": "FLODL_RUN_DIR",
    "SEED": "FLODL_SEED",
    "SESSION_KEY": "FLODL_SESSION_KEY",
    "SESSION_KEY_FILE": "FLODL_SESSION_KEY_FILE",
    "WORLD_SIZE": "WORLD_SIZE",
}

_ENV_KEY = re.compile(r"[A-Z][A-Z0-9_]{2,}")
_ENV_OBJECTS = frozenset({"env", "environ", "environment"})
"""Names (or attribute names: ``os.environ``) of the mappings flodl reads variables from."""
_ENV_METHODS = frozenset({"get", "setdefault", "pop"})
_WRITERS = frozenset({"variables"})
"""Functions that build a rank's variables as a dict (``RankEnv``, ``TorchrunLayout``)."""


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_env(node: ast.expr) -> bool:
    return _last_name(node) in _ENV_OBJECTS


class _EnvKeys(ast.NodeVisitor):
    """The expressions a module uses as environment variable names."""

    def __init__(self) -> None:
        self.keys: list[ast.expr] = []
        self._function: list[str] = []

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._function.append(node.name)
        self.generic_visit(node)
        self._function.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Subscript(self, node: ast.Subscript) -> None:
        # env["X"], os.environ[X], variables["X"] inside variables()
        if _is_env(node.value) or (self._function[-1:] and self._function[-1] in _WRITERS):
            self.keys.append(node.slice)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in _ENV_METHODS
            and _is_env(func.value)
            and node.args
        ):
            self.keys.append(node.args[0])  # env.get("X"), os.environ.setdefault(X, ...)
        elif _last_name(func) == "getenv" and node.args:
            self.keys.append(node.args[0])  # os.getenv("X")
        elif any(_is_env(arg) for arg in node.args):
            self.keys.extend(node.args)  # a helper that reads env: _int(env, "X")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        # "X" in env, X not in os.environ
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, ast.In | ast.NotIn) and _is_env(right):
                self.keys.append(node.left)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        # {"RANK": ..., COORDINATOR: ...} built inside variables()
        if self._function[-1:] and self._function[-1] in _WRITERS:
            self.keys.extend(key for key in node.keys if key is not None)
        self.generic_visit(node)


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """``NAME = "text"`` at a module's top level."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found[target.id] = node.value.value
    return found


def _aliases(tree: ast.Module) -> dict[str, str]:
    """``from m import NAME as alias``: alias -> NAME."""
    return {
        alias.asname: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname
    }


def _scanned_env_vars() -> set[str]:
    """Every variable name the package uses as an environment key, from its source text."""
    package = Path(flodl.__file__).parent
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    constants: dict[str, set[str]] = {}  # a constant's name -> its values, over every module
    found: set[str] = set()
    for tree in trees.values():
        for name, value in _module_constants(tree).items():
            constants.setdefault(name, set()).add(value)
            if name.endswith(("_ENV", "_VAR")):
                found.add(value)
    for tree in trees.values():
        aliases = _aliases(tree)
        visitor = _EnvKeys()
        visitor.visit(tree)
        for key in visitor.keys:
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.add(key.value)
            elif (ref := _last_name(key)) is not None:
                found |= constants.get(aliases.get(ref, ref), set())
    return {name for name in found if _ENV_KEY.fullmatch(name)}


def test_environment_variables_in_source() -> None:
    found = _scanned_env_vars()
    assert sorted(found - ENV_VARS) == [], "variables flodl now uses that are not pinned"
    assert sorted(ENV_VARS - found) == [], "pinned variables flodl no longer uses"


def test_environment_constants() -> None:
    import flodl.host.environment

    values = {name: getattr(flodl.host.environment, name, None) for name in ENVIRONMENT_CONSTANTS}
    assert values == ENVIRONMENT_CONSTANTS


def test_other_env_constants() -> None:
    from flodl.backends.nccl import ERROR_HANDLING_ENV
    from flodl.worker.signals import ENV_VAR

    assert ENV_VAR == "FLODL_STOP_ON_SIGNALS"
    assert ERROR_HANDLING_ENV == "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def test_rank_env_writes_the_documented_variables() -> None:
    from flodl.core.common.policy import Policy
    from flodl.host.environment import RankEnv

    written = RankEnv(
        coordinator="tcp://127.0.0.1:29400",
        rank=1,
        world_size=2,
        local_rank=1,
        local_world_size=2,
        session_key_file=Path("/k"),
        master_addr="127.0.0.1",
        master_port=29500,
        backend="gloo",
        policy=Policy.CADENCE,
        heartbeat_timeout=10.0,
        heartbeat_interval=1.0,
        run_dir=Path("/r"),
        seed=0,
        host="127.0.0.1",
        join_timeout=300.0,
        op_timeout=30.0,
        resume=Path("/b"),
        debug_param_hashes=True,
        keep_checkpoints=2,
    ).variables()
    assert sorted(written) == sorted(set(ENVIRONMENT_CONSTANTS.values()) - {"FLODL_SESSION_KEY"})


# --- wire tags -----------------------------------------------------------------------------------

TO_RANK_TAGS = {
    "SyncNow": 1,
    "SetGlobalStep": 2,
    "StartEpoch": 3,
    "ExtendPartition": 4,
    "DeclareDead": 5,
    "RequestNewGroup": 6,
    "NewGroupSession": 7,
    "Throttle": 8,
    "Checkpoint": 9,
    "SaveConsensusModel": 10,
    "Shutdown": 11,
    "ShutdownWithSave": 12,
    "CoordHeartbeat": 13,
    "EpochAggregated": 14,
    "Abort": 15,
    "RunSettings": 16,
}

TO_COORDINATOR_TAGS = {
    "Batch": 64,
    "SyncAck": 65,
    "Heartbeat": 66,
    "Exiting": 67,
    "NewGroupReady": 68,
    "LrUpdate": 69,
    "Intent": 70,
    "CheckpointResult": 71,
    "Metrics": 72,
    "Note": 73,
    "Ready": 74,
    "Batches": 75,
    "JoinResult": 76,
}

SAVE_REASONS = {
    "GRACEFUL": 0,
    "MAX_FAILURE": 1,
    "SINGLE_SURVIVOR": 2,
    "ALL_RANKS_LOST": 3,
    "REDUCE_STALL": 4,
    "CHECKPOINT": 5,
}

FROM_AGENT_TAGS = {
    "AgentJoin": 128,
    "RankExited": 129,
    "AgentStop": 130,
    "RankOpen": 134,
    "RanksUp": 135,
    "RankClosed": 136,
}
TO_AGENT_TAGS = {
    "AssignRanks": 160,
    "RunOver": 161,
    "AgentRefusal": 162,
    "RanksDown": 165,
    "RankEnd": 166,
    "KillRank": 167,
}
ALL_TAGS = {**TO_RANK_TAGS, **TO_COORDINATOR_TAGS, **FROM_AGENT_TAGS, **TO_AGENT_TAGS}

INTENT_KINDS = {"EVAL_NOW": 0, "CHECKPOINT_NOW": 1, "SAVE_AND_STOP": 2, "STOP": 3}


def test_every_message_tag() -> None:
    from flodl.wire import messages

    tags = {cls.__name__: cls.TAG for cls in messages.BY_TAG.values()}
    assert tags == ALL_TAGS
    assert {tag: cls.__name__ for tag, cls in messages.BY_TAG.items()} == {
        tag: name for name, tag in ALL_TAGS.items()
    }


def test_message_directions() -> None:
    from flodl.wire import messages

    assert {cls.__name__: cls.TAG for cls in messages.TO_RANK} == TO_RANK_TAGS
    assert {cls.__name__: cls.TAG for cls in messages.TO_COORDINATOR} == TO_COORDINATOR_TAGS
    assert {cls.__name__: cls.TAG for cls in messages.FROM_AGENT} == FROM_AGENT_TAGS
    assert {cls.__name__: cls.TAG for cls in messages.TO_AGENT} == TO_AGENT_TAGS


@pytest.mark.parametrize(("name", "tag"), sorted(ALL_TAGS.items()))
def test_message_class_tag(name: str, tag: int) -> None:
    from flodl.wire import messages

    assert getattr(messages, name).TAG == tag


def test_wire_enums() -> None:
    from flodl.wire.messages import IntentKind, SaveReason

    assert {m.name: m.value for m in SaveReason} == SAVE_REASONS
    assert {m.name: m.value for m in IntentKind} == INTENT_KINDS


# --- the run folder ------------------------------------------------------------------------------


def test_run_folder_constants() -> None:
    from flodl.checkpoint.resume import COORDINATOR_META
    from flodl.host.environment import KEY_FILE_NAME
    from flodl.host.rundir import LATEST, LOCK_NAME, RUNS_ROOT
    from flodl.launch.summary import SUMMARY_NAME as LAUNCHER_SUMMARY
    from flodl.observe.events import EVENTS_NAME
    from flodl.observe.events import SCHEMA_VERSION as EVENTS_SCHEMA
    from flodl.observe.history import SUMMARY_NAME
    from flodl.observe.report import REPORT_DIR
    from flodl.worker.records import DEATH_STEM

    assert {
        "COORDINATOR_META": COORDINATOR_META,
        "DEATH_STEM": DEATH_STEM,
        "EVENTS_NAME": EVENTS_NAME,
        "EVENTS_SCHEMA": EVENTS_SCHEMA,
        "KEY_FILE_NAME": KEY_FILE_NAME,
        "LATEST": LATEST,
        "LAUNCHER_SUMMARY": LAUNCHER_SUMMARY,
        "LOCK_NAME": LOCK_NAME,
        "REPORT_DIR": REPORT_DIR,
        "RUNS_ROOT": RUNS_ROOT,
        "SUMMARY_NAME": SUMMARY_NAME,
    } == {
        "COORDINATOR_META": "coordinator.meta.json",
        "DEATH_STEM": "flodl",
        "EVENTS_NAME": "events.jsonl",
        "EVENTS_SCHEMA": 1,
        "KEY_FILE_NAME": "session.key",
        "LATEST": "latest",
        "LAUNCHER_SUMMARY": "summary.json",
        "LOCK_NAME": "flodl.lock",
        "REPORT_DIR": "report",
        "RUNS_ROOT": Path("runs"),
        "SUMMARY_NAME": "summary.json",
    }


def test_run_folder_paths(tmp_path: Path) -> None:
    from flodl.checkpoint.death import death_record_path
    from flodl.checkpoint.resume import checkpoints_dir
    from flodl.worker.persist import checkpoint_dir
    from flodl.worker.records import report_path

    assert report_path(tmp_path, 3) == tmp_path / "rank3.json"
    assert checkpoints_dir(tmp_path) == tmp_path / "checkpoints"
    assert checkpoint_dir(tmp_path, 2) == tmp_path / "checkpoints" / "rank2"
    assert death_record_path(tmp_path, "flodl", 1) == tmp_path / "flodl.rank1.death.json"


# The layout docs/running.md ("The run folder") shows, which flodl recognises as a run's files.
RUN_FILES = [
    "checkpoints/coordinator.meta.json",
    "checkpoints/rank0/flodl-step000000120-v000003.config.json",
    "checkpoints/rank0/flodl-step000000120-v000003.meta.json",
    "checkpoints/rank0/flodl-step000000120-v000003.model.safetensors",
    "checkpoints/rank0/flodl-step000000120-v000003.optim.json",
    "checkpoints/rank0/flodl-step000000120-v000003.optim.safetensors",
    "checkpoints/rank0/flodl-step000000120-v000003.outer.safetensors",
    "checkpoints/rank0/flodl-step000000120-v000003.rank1.death.json",
    "checkpoints/rank0/latest.json",
    "coordinator.sock",
    "events.1.jsonl",
    "events.jsonl",
    "flodl.rank1.death.json",
    "rank0.1.log",
    "rank0.json",
    "rank0.log",
    "session.key",
    "summary.json",
]


def test_run_files_recognised(tmp_path: Path) -> None:
    from flodl.host.rundir import run_files

    for name in [*RUN_FILES, "flodl.lock", "notes.txt", "report/index.html"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    found = [path.relative_to(tmp_path).as_posix() for path in run_files(tmp_path)]
    assert sorted(found) == RUN_FILES


# --- checkpoints ---------------------------------------------------------------------------------

META_KEYS = [
    "created_unix",
    "elche_state",
    "epoch",
    "files",
    "flodl_version",
    "global_step",
    "guard_state",
    "save_reason",
    "schema_version",
    "sync_round",
    "world_size_at_save",
]


def test_checkpoint_constants() -> None:
    from flodl.checkpoint import SCHEMA_VERSION
    from flodl.checkpoint.bundle import TREE_FORMAT
    from flodl.checkpoint.files import TEMP_MARKER
    from flodl.checkpoint.meta import LOSS_REASON, MANIFEST_KEY
    from flodl.checkpoint.names import (
        CONFIG_SUFFIX,
        LATEST_NAME,
        META_SUFFIX,
        MODEL_SUFFIX,
        OPTIM_STRUCTURE_SUFFIX,
        OPTIM_TENSORS_SUFFIX,
        OUTER_SUFFIX,
    )
    from flodl.checkpoint.prune import FLODL_STEM

    assert {
        "CONFIG_SUFFIX": CONFIG_SUFFIX,
        "FLODL_STEM": FLODL_STEM.pattern,
        "LATEST_NAME": LATEST_NAME,
        "LOSS_REASON": LOSS_REASON,
        "MANIFEST_KEY": MANIFEST_KEY,
        "META_SUFFIX": META_SUFFIX,
        "MODEL_SUFFIX": MODEL_SUFFIX,
        "OPTIM_STRUCTURE_SUFFIX": OPTIM_STRUCTURE_SUFFIX,
        "OPTIM_TENSORS_SUFFIX": OPTIM_TENSORS_SUFFIX,
        "OUTER_SUFFIX": OUTER_SUFFIX,
        "SCHEMA_VERSION": SCHEMA_VERSION,
        "TEMP_MARKER": TEMP_MARKER,
        "TREE_FORMAT": TREE_FORMAT,
    } == {
        "CONFIG_SUFFIX": ".config.json",
        "FLODL_STEM": r"flodl-step\d{9}(-v\d{6})?",
        "LATEST_NAME": "latest.json",
        "LOSS_REASON": "COORDINATOR_LOST",
        "MANIFEST_KEY": "files",
        "META_SUFFIX": ".meta.json",
        "MODEL_SUFFIX": ".model.safetensors",
        "OPTIM_STRUCTURE_SUFFIX": ".optim.json",
        "OPTIM_TENSORS_SUFFIX": ".optim.safetensors",
        "OUTER_SUFFIX": ".outer.safetensors",
        "SCHEMA_VERSION": 3,
        "TEMP_MARKER": ".tmp-",
        "TREE_FORMAT": "flodl-state-tree/1",
    }


def _meta(global_step: int) -> Any:
    from flodl.checkpoint import CheckpointMeta

    return CheckpointMeta(
        epoch=1,
        global_step=global_step,
        sync_round=7,
        world_size_at_save=2,
        save_reason="GRACEFUL",
        elche_state=None,
        guard_state=None,
        created_unix=1_700_000_000.0,
        flodl_version="0.1.0",
    )


def _safetensors_metadata(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8 : 8 + size])
    metadata: dict[str, str] = header["__metadata__"]
    return metadata


def test_default_stem() -> None:
    from flodl.checkpoint import default_stem

    assert default_stem(_meta(1234)) == "flodl-step000001234"


def test_bundle_round_trip(tmp_path: Path) -> None:
    import torch

    from flodl.checkpoint import default_stem, load_bundle, save_bundle, write_death_record

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    meta = _meta(42)
    stem = default_stem(meta)
    path = save_bundle(
        tmp_path,
        stem,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        meta=meta,
        config={"lr": 0.1},
    )
    assert path == tmp_path / "flodl-step000000042"
    write_death_record(tmp_path, stem, rank=1, world_size=2, error="gone")

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "flodl-step000000042.config.json",
        "flodl-step000000042.meta.json",
        "flodl-step000000042.model.safetensors",
        "flodl-step000000042.optim.json",
        "flodl-step000000042.optim.safetensors",
        "flodl-step000000042.rank1.death.json",
        "latest.json",
    ]
    assert json.loads((tmp_path / "latest.json").read_text()) == {"stem": stem}

    raw = json.loads((tmp_path / f"{stem}.meta.json").read_text())
    assert sorted(raw) == META_KEYS
    assert raw["schema_version"] == 3
    assert sorted(raw["files"]) == ["config", "model", "optim_structure", "optim_tensors"]
    assert {role: entry["file"] for role, entry in raw["files"].items()} == {
        "config": "flodl-step000000042.config.json",
        "model": "flodl-step000000042.model.safetensors",
        "optim_structure": "flodl-step000000042.optim.json",
        "optim_tensors": "flodl-step000000042.optim.safetensors",
    }
    for entry in raw["files"].values():
        assert sorted(entry) == ["bytes", "file", "sha256"]

    assert _safetensors_metadata(tmp_path / f"{stem}.model.safetensors") == {
        "format": "flodl-model",
        "order": json.dumps(["weight", "bias"]),
    }
    assert _safetensors_metadata(tmp_path / f"{stem}.optim.safetensors") == {
        "format": "flodl-state-tree/1"
    }
    structure = json.loads((tmp_path / f"{stem}.optim.json").read_text())
    assert sorted(structure) == ["format", "structure"]
    assert structure["format"] == "flodl-state-tree/1"
    death = json.loads((tmp_path / f"{stem}.rank1.death.json").read_text())
    assert sorted(death) == ["error", "rank", "unix_time_secs", "world_size"]

    bundle = load_bundle(tmp_path)
    assert bundle.path == path
    assert bundle.meta == meta
    assert bundle.config == {"lr": 0.1}
    assert [d.rank for d in bundle.deaths] == [1]
    assert list(bundle.model_state) == ["weight", "bias"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(bundle.model_state[name], tensor)
    assert bundle.optimizer_state is not None
    assert sorted(bundle.optimizer_state) == ["param_groups", "state"]
