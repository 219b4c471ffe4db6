"""The run as Prometheus metrics (``/metrics``), in a registry of its own.

Counters and histograms are fed from the event records as they arrive
(:meth:`Observer.on_record`; each record costs a few dict lookups and at most two
increments); per-rank and run gauges are read from :meth:`Observer.state` when scraped. The
registry is this run's only, never prometheus-client's global one, so two runs in one process
(tests, benchmarks) do not share counts. Names follow Prometheus conventions: ``_total`` for
counters, base units (seconds, ratios 0..1). docs/observability.md lists them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from flodl.core.coordinator.record import RunRecord
from flodl.observe.hub import Observer

__all__ = ["CONTENT_TYPE", "RunMetrics", "StepClock"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The text exposition format's content type."""

ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Averaging rounds: milliseconds on one host to a minute for a big model over a slow link."""
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Regroups: from a fast local re-rendezvous to the 300 s stall ceiling."""


class StepClock:
    """When each rank last ran a batch, as far as the coordinator's per-rank batch counters
    (``record.stats[rank].batches``) show: :meth:`check` notes the time whenever a count moved.
    It is checked at every event record and every scrape, so an age is low by at most the time
    since the check before (a round, or a scrape interval)."""

    def __init__(self, record: RunRecord) -> None:
        self._record = record
        self._batches: dict[int, int] = {}
        self._at: dict[int, float] = {}

    def check(self, now: float) -> None:
        """Note ``now`` for each rank whose batch count moved since the last check."""
        for rank, stats in enumerate(self._record.stats):
            batches = int(stats.batches)
            if batches != self._batches.get(rank, 0):
                self._at[rank] = now
            self._batches[rank] = batches

    def ages(self, now: float) -> dict[int, float]:
        """Seconds since each rank that has run a batch last did (as of the last check)."""
        return {rank: max(now - at, 0.0) for rank, at in self._at.items()}


class _LiveCollector(Collector):
    """The gauges, read at scrape time from the observer's state."""

    def __init__(self, observer: Observer, steps: StepClock) -> None:
        self._observer = observer
        self._steps = steps

    def collect(self) -> Iterator[Metric]:
        now = trio.current_time()
        self._steps.check(now)
        state = self._observer.state()
        rows: list[Mapping[str, Any]] = state["ranks"]
        per_rank = {
            "samples_per_s": GaugeMetricFamily(
                "flodl_rank_samples_per_second",
                "Samples per second the rank trains at (its last window, idle time left out)",
                labels=["rank"],
            ),
            "idle_share": GaugeMetricFamily(
                "flodl_rank_idle_ratio",
                "Share of the rank's time spent waiting for the others (0..1, whole run)",
                labels=["rank"],
            ),
            "averaging_share": GaugeMetricFamily(
                "flodl_rank_averaging_ratio",
                "Share of the rank's time spent averaging parameters (0..1, whole run)",
                labels=["rank"],
            ),
            "heartbeat_age_s": GaugeMetricFamily(
                "flodl_rank_heartbeat_age_seconds",
                "Seconds since the coordinator last heard from the rank (live ranks only)",
                labels=["rank"],
            ),
            "window_batches": GaugeMetricFamily(
                "flodl_rank_window_batches",
                "Batches ElChe gave the rank for the window in progress",
                labels=["rank"],
            ),
            "divergence": GaugeMetricFamily(
                "flodl_rank_divergence",
                "The rank's parameter divergence from the average at its last round",
                labels=["rank"],
            ),
        }
        batches = CounterMetricFamily(
            "flodl_rank_batches", "Batches the rank trained (rounds settled)", labels=["rank"]
        )
        up = GaugeMetricFamily(
            "flodl_rank_up", "1 while the rank is joined or training, else 0", labels=["rank"]
        )
        step_age = GaugeMetricFamily(
            "flodl_rank_last_step_age_seconds",
            "Seconds since the rank last ran a batch (stuck-trainer alerts)",
            labels=["rank"],
        )
        ages = self._steps.ages(now)
        for row in rows:
            label = [str(row["rank"])]
            for key, family in per_rank.items():
                value = row.get(key)
                if isinstance(value, int | float):
                    family.add_metric(label, float(value))
            batches.add_metric(label, float(row.get("batches") or 0))
            live = row.get("state") in ("joined", "training")
            up.add_metric(label, 1.0 if live else 0.0)
            age = ages.get(int(row["rank"]))
            if age is not None and live:
                step_age.add_metric(label, age)
        yield from per_rank.values()
        yield batches
        yield up
        yield step_age
        yield from _run_gauges(state)
        yield GaugeMetricFamily(
            "flodl_coordinator_tasks",
            "Trio tasks alive in the coordinator's process (flat in a healthy long run)",
            value=float(trio.lowlevel.current_statistics().tasks_living),
        )


def _run_gauges(state: Mapping[str, Any]) -> Iterator[Metric]:
    simple = (
        ("round", "flodl_round", "The latest averaging round that settled"),
        ("generation", "flodl_generation", "The collective group's generation"),
        ("global_step", "flodl_global_step", "Global step at the latest round"),
        ("epoch", "flodl_epoch", "The epoch in progress"),
        ("world_size", "flodl_world_size", "Ranks the run was started with"),
        ("progress", "flodl_progress_ratio", "Share of the run's batches done (0..1)"),
        ("eta_s", "flodl_eta_seconds", "Seconds left at the pace so far"),
        ("samples_per_s", "flodl_samples_per_second", "Samples per second of all live ranks"),
        ("last_loss", "flodl_last_loss", "Average loss of the latest epoch"),
    )
    for key, name, help_text in simple:
        value = state.get(key)
        if isinstance(value, int | float):
            yield GaugeMetricFamily(name, help_text, value=float(value))
    finished = 1.0 if state.get("status") not in ("joining", "training") else 0.0
    yield GaugeMetricFamily("flodl_finished", "1 once the run ended", value=finished)


class RunMetrics:
    """The run's metrics registry, fed by ``observer``'s records from construction on (the
    records it already holds are counted first, so a dashboard started late counts from the
    run's start)."""

    def __init__(self, observer: Observer) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.rounds = Counter("flodl_rounds", "Averaging rounds that settled", registry=reg)
        self.redo_rounds = Counter(
            "flodl_redo_rounds", "Rounds redone on a re-formed group", registry=reg
        )
        self.deaths = Counter("flodl_deaths", "Ranks declared dead or gone", registry=reg)
        self.regroups = Counter("flodl_regroups", "Collective groups re-formed", registry=reg)
        self.saves = Counter("flodl_saves", "Checkpoints a rank saved", registry=reg)
        self.save_failures = Counter(
            "flodl_save_failures", "Checkpoint requests a rank failed", registry=reg
        )
        self.round_seconds = Histogram(
            "flodl_averaging_round_seconds",
            "Time from a round's start until every member acknowledged it",
            buckets=ROUND_BUCKETS,
            registry=reg,
        )
        self.recovery_seconds = Histogram(
            "flodl_recovery_seconds",
            "Time a regroup took (a death until the re-formed group was ready)",
            buckets=RECOVERY_BUCKETS,
            registry=reg,
        )
        self.steps = StepClock(observer.coordinator.record)
        reg.register(_LiveCollector(observer, self.steps))
        # process_open_fds, process_resident_memory_bytes, ...: the coordinator's own process
        ProcessCollector(registry=reg)
        for record in observer.history:
            self.take(record)
        observer.on_record(self.take)

    def take(self, record: Mapping[str, Any]) -> None:
        """Count one event record (an :meth:`Observer.on_record` listener: never waits)."""
        kind = record.get("kind")
        if kind == "SyncEnd":
            self.rounds.inc()
            duration = record.get("duration_s")
            if isinstance(duration, int | float):
                self.round_seconds.observe(float(duration))
        elif kind == "SyncStart" and record.get("redo"):
            self.redo_rounds.inc()
        elif kind == "RankDead":
            self.deaths.inc()
        elif kind == "GroupReformed":
            self.regroups.inc()
            took = record.get("took_s")
            if isinstance(took, int | float):
                self.recovery_seconds.observe(float(took))
        elif kind == "CheckpointSaved":
            (self.save_failures if record.get("error") else self.saves).inc()
        self.steps.check(trio.current_time())

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
