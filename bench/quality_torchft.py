"""The torchft peers of the time-to-quality bench: ``LocalSGD`` and ``DiLoCo`` (torchft 0.2.0).

One run is ``nproc`` single-process replica groups and a lighthouse, on one machine:

* **Replicas.** Each builds ``build_task(spec.workload, spec.seed)`` (the same data and initial
  parameters everywhere; inner optimizer: the task's own), runs one torch thread, hosts its own
  ``TCPStore`` on 127.0.0.1 and builds ``Manager(pg=ProcessGroupGloo(), min_replica_size=nproc,
  load_state_dict, state_dict, replica_id, rank=0, world_size=1, lighthouse_addr, store_addr,
  store_port, hostname="127.0.0.1", init_sync=False)`` (``init_sync=False``: the initial
  parameters are seeded identically, as torchft's docs advise; DiLoCo also needs
  ``use_async_quorum=False``). Then it trains under ``LocalSGD(manager, model, optimizer,
  sync_every)`` (parameters averaged every ``sync_every`` local steps) or ``DiLoCo(manager,
  [model], optimizer, outer, sync_every)`` with the outer optimizer of DiLoCo's paper,
  ``SGD(lr=0.7, momentum=0.9, nesterov=True)`` on the averaged pseudo-gradients.
  Replica ``spec.slow_rank`` is ``spec.slow_factor`` slower exactly as in the other runs
  (:func:`quality_task.train_step`; the time spent in torchft's sync, waiting for the others
  included, is communication and is not slowed down).
* **Data.** Replica ``i`` trains batches ``i, i + nproc, ...`` (the workload's batch size) of
  the epoch order :func:`quality_task.sample_order`, as DDP's ranks do.
* **Start.** Every replica waits at a file barrier until all ``nproc`` Managers exist, then
  takes one quorum before its first batch; the lighthouse (``--min_replicas nproc``,
  ``--quorum_tick_ms 10``, ``--join_timeout_ms 1000``) issues it only with every replica in
  it, and a replica whose first quorum has fewer participants fails the run. Every later
  quorum holds the same members (torchft's "fast quorum", no process group re-forming).
* **sync_every** (:data:`SYNC_EVERY`, local steps between syncs): flodl's cadence windows in
  ``bench/results/quality*.json`` (60 s budgets) hold 24-28 batches of the fast rank 0 on
  ``gpt`` (2 and 4 ranks; about 2.4 s at 2 ranks, where a gpt step takes about 85 ms) and
  about 33 on ``digits`` (about 0.37 s, a digits step takes about 6 ms). So ``gpt``: 24
  (about 2 s of a fast replica's compute), ``digits``: 32. torchft syncs in lock-step: at each
  sync the fast replicas wait for the slow one (the peer's real behaviour, kept).
* **The clock.** Replica 0 keeps the :class:`~quality_task.BudgetClock` and evaluates its
  current model (for DiLoCo: the inner, local model) between steps, as the flodl and DDP runs
  do; the others wait for it at the next sync.
* **Namespace.** torchft's listeners (the ManagerServer on ``[::]``, its checkpoint HTTP
  server, the stores) bind every interface, so a run happens inside a fresh network namespace
  that holds only loopback: ``unshare -n sh -c 'ip link set lo up && exec "$0" "$@"' python
  quality_torchft.py _trial trial.json`` (that process, the *runner*, starts the lighthouse on
  127.0.0.1 and the replicas; ``GLOO_SOCKET_IFNAME=lo``).
* **The end.** Once its budget is spent replica 0 evaluates its current model, writes
  ``result.json`` and leaves with ``os._exit`` (gloo's threads may abort an interpreter's
  teardown). A sync due after a step whose compute spent the budget is not taken (an optimizer
  post-hook before torchft's raises :class:`BudgetSpent`): what follows the budget is not on
  the curve, as with flodl's last round, instead of a last point seconds past the budget
  (the wait for the slow replica; ``last_sync_cut`` in the result). The runner then kills the
  lighthouse and the other replicas (blocked in a sync that will never complete) and exits.
  The host side (:func:`run_torchft`) started the runner as the leader of a new session; it
  waits for it up to ``deadline_s(spec)`` + :data:`STARTUP_EXTRA_S`, then sends the runner's
  group SIGTERM, then SIGKILL, and SIGKILLs every pid the run's processes left in
  ``spec.result_dir`` (``torchft-runner``, ``torchft-lighthouse``, ``torchft<i>``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch
from quality_baselines import deadline_s
from quality_procs import Processes, alive, kill_group, pids_in, wait_for_exits
from quality_task import (
    BudgetClock,
    RunSpec,
    build_task,
    sample_order,
    train_step,
    write_pid,
    write_result,
)

__all__ = ["ALGORITHMS", "SYNC_EVERY", "run_torchft", "unavailable"]

HERE = Path(__file__).resolve()
ALGORITHMS = ("localsgd", "diloco")
SYNC_EVERY: dict[str, int] = {"gpt": 24, "digits": 32}
"""Local steps between two syncs, per workload (module docstring: flodl's windows)."""
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
LIGHTHOUSE_PORT = 29510
"""The lighthouse's port: a fresh namespace per run, so nothing else listens there."""
LIGHTHOUSE_ARGS = ("--quorum_tick_ms", "10", "--join_timeout_ms", "1000")
STARTUP_EXTRA_S = 60.0
"""Seconds beyond ``deadline_s(spec)`` a run may take: torchft's start-up (lighthouse, stores,
Managers, the first quorum and process group) in every replica."""
READY_TIMEOUT_S = 180.0
"""How long a replica waits for the lighthouse and for the other replicas' Managers."""
TERM_GRACE_S = 5.0


# --------------------------------------------------------------------------- availability


def unavailable() -> str | None:
    """Why the torchft peers cannot run here; None when they can (torchft importable, a
    loopback-only network namespace creatable: ``peers_bench.peer_unavailable``, and torchft's
    lighthouse beside this interpreter)."""
    from peers_bench import peer_unavailable  # lazily: the replicas import this module

    reason = peer_unavailable()
    if reason is None and not lighthouse_binary().exists():
        reason = f"torchft is installed but {lighthouse_binary()} is missing"
    return reason


def lighthouse_binary() -> Path:
    """torchft's ``torchft_lighthouse`` console script of this interpreter's environment."""
    return Path(sys.executable).with_name("torchft_lighthouse")


# --------------------------------------------------------------------------- a run's layout


@attrs.frozen
class Trial:
    """What the runner and the replicas of one run are told (``trial.json``)."""

    algorithm: str
    nproc: int
    sync_every: int
    folder: str
    """Logs, the barrier and ``trial.json`` (the results go to ``spec.result_dir``)."""
    spec: RunSpec

    @property
    def path(self) -> Path:
        return Path(self.folder) / f"torchft-{self.algorithm}.json"

    @property
    def barrier(self) -> Path:
        return Path(self.folder) / f"torchft-{self.algorithm}-barrier"

    @property
    def lighthouse_addr(self) -> str:
        return f"http://127.0.0.1:{LIGHTHOUSE_PORT}"

    def save(self) -> None:
        """Write ``trial.json`` (read back by :func:`load_trial`)."""
        data = attrs.asdict(self, recurse=False)
        data["spec"] = attrs.asdict(self.spec)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data))

    def runner_command(self) -> list[str]:
        """The host's command: the runner, inside a fresh loopback-only namespace."""
        return [
            "unshare",
            "-n",
            "sh",
            "-c",
            'ip link set lo up && exec "$0" "$@"',
            sys.executable,
            str(HERE),
            "_trial",
            str(self.path),
        ]

    def lighthouse_command(self) -> list[str]:
        return [
            str(lighthouse_binary()),
            "--bind",
            f"127.0.0.1:{LIGHTHOUSE_PORT}",
            "--min_replicas",
            str(self.nproc),
            *LIGHTHOUSE_ARGS,
        ]

    def replica_command(self, replica: int) -> list[str]:
        return [sys.executable, str(HERE), "_replica", str(self.path), str(replica)]

    def commands(self) -> list[list[str]]:
        """Every command of the run: the runner's, the lighthouse's, each replica's."""
        return [
            self.runner_command(),
            self.lighthouse_command(),
            *(self.replica_command(r) for r in range(self.nproc)),
        ]


def load_trial(path: Path) -> Trial:
    """The :class:`Trial` that :meth:`Trial.save` wrote to ``path``."""
    data = json.loads(path.read_text())
    data["spec"] = RunSpec(**data["spec"])
    return Trial(**data)


def log_tail(folder: Path, algorithm: str, chars: int = 3000) -> str:
    """The end of every log of a run, for an error message."""
    parts = []
    for log in sorted(folder.glob(f"torchft-{algorithm}-*.log")):
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- the host side


def run_torchft(
    algorithm: str, spec: RunSpec, nproc: int, folder: Path, *, sync_every: int | None = None
) -> dict[str, Any]:
    """One torchft run of ``nproc`` replicas (``algorithm``: ``localsgd`` or ``diloco``);
    ``{"result": replica 0's result.json, "commands": [...], "pids": [...]}``.

    When it returns or raises, no process the run started is left alive. RuntimeError (with
    the logs' tails) when replica 0 wrote no result: a process failed, or the deadline passed.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown torchft algorithm {algorithm!r} (not in {ALGORITHMS})")
    trial = Trial(
        algorithm=algorithm,
        nproc=nproc,
        sync_every=sync_every or SYNC_EVERY[spec.workload],
        folder=str(folder.resolve()),
        spec=spec,
    )
    shutil.rmtree(trial.barrier, ignore_errors=True)
    spec.result_path.unlink(missing_ok=True)  # only this run's result counts
    trial.save()
    result_dir = Path(spec.result_dir)
    limit = deadline_s(spec) + STARTUP_EXTRA_S
    with Processes() as processes:
        runner = processes.start(trial.runner_command(), folder / f"torchft-{algorithm}-runner.log")
        wait_for_exits([runner.pid], limit, every=True)
        timed_out = runner.poll() is None
        terminate_group(runner.pid)
        processes.adopt(pids_in(result_dir))
    leftover = [pid for pid in processes.pids if alive(pid)]
    for pid in leftover:  # Processes killed them all; a last sweep, then a last wait
        kill_group(pid)
    wait_for_exits(leftover, 5.0, every=True)
    if not spec.result_path.exists():
        why = f"no result after {limit:.0f} s" if timed_out else f"runner exit {runner.returncode}"
        raise RuntimeError(f"torchft {algorithm}: {why}\n{log_tail(folder, algorithm)}")
    result: dict[str, Any] = json.loads(spec.result_path.read_text())
    return {"result": result, "commands": trial.commands(), "pids": processes.pids}


def terminate_group(leader: int) -> None:
    """SIGTERM the process group ``leader`` leads, SIGKILL it after :data:`TERM_GRACE_S` if the
    leader is still alive, then SIGKILL whatever is left in the group."""
    kill_group(leader, signal.SIGTERM)
    wait_for_exits([leader], TERM_GRACE_S, every=True)
    kill_group(leader, signal.SIGKILL)


# --------------------------------------------------------------------------- the runner


def trial_main(path: Path) -> int:
    """Inside the namespace: start the lighthouse and the replicas; return once replica 0 has
    exited (0: it wrote its result) or any other process exited first (1). Kills and reaps
    every process it started before returning."""
    trial = load_trial(path)
    spec = trial.spec
    write_pid(spec, "torchft-runner")
    folder = Path(trial.folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    children: list[subprocess.Popen[bytes]] = []

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        with (folder / f"torchft-{trial.algorithm}-{name}.log").open("wb") as sink:
            child = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env
            )
        children.append(child)
        return child

    names = ["lighthouse", *(f"replica{r}" for r in range(trial.nproc))]
    code = 1
    try:
        lighthouse = start(names[0], trial.lighthouse_command())
        (Path(spec.result_dir) / "torchft-lighthouse.pid").write_text(str(lighthouse.pid))
        keeper = start(names[1], trial.replica_command(0))
        for replica in range(1, trial.nproc):
            start(names[replica + 1], trial.replica_command(replica))
        while True:
            running = [c.pid for c in children if c.poll() is None]
            if keeper.returncode is not None:
                code = 0 if keeper.returncode == 0 and spec.result_path.exists() else 1
                print(f"torchft runner: replica 0 exited {keeper.returncode}", flush=True)
                break
            if len(running) < len(children):
                gone = {
                    name: child.returncode
                    for name, child in zip(names, children, strict=True)
                    if child.returncode is not None
                }
                print(f"torchft runner: exited before replica 0's result: {gone}", flush=True)
                break
            wait_for_exits(running, 60.0, every=False)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        for child in children:
            child.wait()
    return code


# --------------------------------------------------------------------------- a replica


class SyncTimer:
    """Seconds spent in torchft's sync: optimizer post-hooks registered before and after the
    algorithm's own (post-hooks run in registration order)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.pending = 0.0
        self.total_s = 0.0

    def before(self, *_: Any) -> None:
        self.started = time.perf_counter()

    def after(self, *_: Any) -> None:
        spent = time.perf_counter() - self.started
        self.pending += spent
        self.total_s += spent

    def take(self) -> float:
        """The seconds since the last take (``train_step``'s communication)."""
        taken, self.pending = self.pending, 0.0
        return taken


class BudgetSpent(Exception):
    """Replica 0's budget ran out in a step's compute, before the step's optimizer post-hooks
    (torchft's sync among them) ran."""


def guard_budget(clock: BudgetClock) -> Callable[..., None]:
    """An optimizer post-hook, registered before the algorithm's: raises :class:`BudgetSpent`
    once ``clock``'s budget is spent, so a sync that would start after the budget (and wait
    for the slow replica, seconds on gpt) is not on the curve, as flodl's last round is not."""

    def guard(*_: Any) -> None:
        if clock.over():
            raise BudgetSpent

    return guard


def wait_for_port(port: int, timeout_s: float) -> None:
    """Return once something listens on 127.0.0.1:``port``; SystemExit after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"the lighthouse is not listening on {port} after {timeout_s:.0f} s")


def barrier(folder: Path, replica: int, nproc: int) -> None:
    """Mark ``replica`` ready; return once all ``nproc`` are. SystemExit on timeout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"replica{replica}.ready").touch()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while sum((folder / f"replica{r}.ready").exists() for r in range(nproc)) < nproc:
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica}: barrier timed out after {READY_TIMEOUT_S} s")
        time.sleep(0.02)


def replica_main(trial: Trial, replica: int) -> None:
    """Train as replica ``replica``; replica 0 writes ``result.json`` and ``os._exit(0)``s once
    its budget is spent. The others train until they are killed."""
    from torch._C._distributed_c10d import TCPStore
    from torchft import Manager, ProcessGroupGloo  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from torchft.local_sgd import DiLoCo, LocalSGD  # type: ignore[import-untyped, import-not-found, unused-ignore]

    spec, nproc = trial.spec, trial.nproc
    write_pid(spec, f"torchft{replica}")
    torch.set_num_threads(1)
    task = build_task(spec.workload, spec.seed)
    model, optimizer = task.model, task.optimizer
    keeper = replica == 0
    clock = BudgetClock(spec.budget_s, spec.points)
    if keeper:
        clock.evaluate(task.validation_loss, step=0)  # the initial model, before the barrier

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    wait_for_port(LIGHTHOUSE_PORT, READY_TIMEOUT_S)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager: Any = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=nproc,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{replica}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=trial.lighthouse_addr,
        hostname="127.0.0.1",
        use_async_quorum=trial.algorithm != "diloco",  # DiLoCo requires a synchronous quorum
        init_sync=False,  # identical seeded parameters: no checkpoint transfer at step 0
        quorum_timeout=timedelta(seconds=READY_TIMEOUT_S),
    )
    barrier(trial.barrier, replica, nproc)
    manager.start_quorum()
    participants = int(manager.num_participants())  # waits for the first quorum
    if participants != nproc:
        raise SystemExit(f"replica {replica}: first quorum has {participants} of {nproc}")
    timer = SyncTimer()
    if keeper:
        optimizer.register_step_post_hook(guard_budget(clock))  # before the algorithm's hook
    optimizer.register_step_post_hook(timer.before)  # before the algorithm's post-hook
    algorithm: Any
    if trial.algorithm == "localsgd":
        algorithm = LocalSGD(manager, model, optimizer, sync_every=trial.sync_every)
    else:
        outer = torch.optim.SGD(
            model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
        )
        algorithm = DiLoCo(manager, [model], optimizer, outer, sync_every=trial.sync_every)
    factor = spec.factor(replica)
    size = task.batch_size
    per_step = size * nproc
    steps = epoch = 0
    loss = float("nan")
    with algorithm:
        optimizer.register_step_post_hook(timer.after)  # after the algorithm's post-hook
        while True:
            order = sample_order(task.dataset_size, epoch, spec.seed)
            for step in range(len(order) // per_step):
                first = step * per_step + replica * size
                clock.start()
                cut = False
                try:
                    loss = train_step(task, order[first : first + size], factor, None, timer.take)
                except BudgetSpent:
                    cut = True  # this step's sync, after the budget, is not on the curve
                steps += 1
                if keeper and clock.tick(task, step=steps, syncs=manager.current_step()):
                    write_result(
                        spec,
                        clock,
                        steps=steps,
                        samples=steps * size,
                        epochs=epoch,
                        syncs=manager.current_step(),
                        sync_attempts=(steps - cut) // trial.sync_every,
                        sync_every=trial.sync_every,
                        sync_s=round(timer.total_s, 3),
                        last_sync_cut=cut,
                        first_quorum_participants=participants,
                        algorithm=trial.algorithm,
                        train_loss=loss,
                    )
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
            epoch += 1


def main(argv: list[str]) -> int:
    """``_trial TRIAL_JSON`` (the runner) or ``_replica TRIAL_JSON REPLICA``."""
    if argv[:1] == ["_trial"] and len(argv) == 2:
        return trial_main(Path(argv[1]))
    if argv[:1] == ["_replica"] and len(argv) == 3:
        replica_main(load_trial(Path(argv[1])), int(argv[2]))
        return 0
    print(f"usage: {HERE.name} _trial TRIAL_JSON | _replica TRIAL_JSON REPLICA", file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's and torchft's slow teardown (threads, servers)
