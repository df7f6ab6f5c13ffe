"""A training run's TensorBoard event files read back: the scalars tools/plot_runs.py draws and
tools/time_to_quality.py measures, against iterations, tokens or wall-clock time.

What the trainer writes with --tensorboard-dir (megatron.training.logging.TensorBoardLogger,
rank 0 only) and what is read here:
- `lm loss`, `throughput/tokens-per-second-per-gpu` and `iteration-time` (seconds per
  iteration, evaluations and checkpoint saves left out) at every --log-interval; `lm loss
  validation` at every evaluation of the validation split, `lm loss test` once, for the test
  split after training; each also as `... vs samples`, the same values with the consumed
  samples as their step. Pairing a scalar's events with its `vs samples` twin gives the
  consumed samples at each iteration (with a batch-size ramp-up they are not proportional).
- the run's arguments as text (Megatron's write_args_to_tensorboard): `seq_length` turns
  consumed samples into tokens.
- with MoE layers, each expert's tokens over its layer's mean at every --log-interval
  (moe.expert_load.EXPERT_LOAD_TAG).

Each job of a run (a start, or a resume from a checkpoint after a stop) writes an event file of
its own; they are read one by one with tensorboard's EventAccumulator, every point kept, in the
order the jobs started. A job that resumes from a checkpoint logs again the iterations between
that checkpoint and where the job before it stopped: the later job's values are kept, so a
resumed run reads as one run (TensorBoard's own directory reader keeps both, since the trainer
writes no restart marker for it to purge by). Each point remembers its job. Wall-clock time
counts from the first event of the first job (written when the trainer started), so it
includes start-up, and for a resumed run the time between its jobs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from megatron.errors import UserError
from megatron.training.logging import (
    ITERATION_TIME,
    SAMPLES_SUFFIX,
    TEST_SUFFIX,
    TOKENS_PER_SECOND_PER_GPU,
    VALIDATION_SUFFIX,
    argument_text_tag,
)
from moe.expert_load import EXPERT_LOAD_TAG

LM_LOSS = "lm loss"  # megatron.composition.forward_step's reported loss
LM_LOSS_VALIDATION = LM_LOSS + VALIDATION_SUFFIX
LM_LOSS_TEST = LM_LOSS + TEST_SUFFIX
# The scalars read as series (the expert load is read apart).
SERIES_TAGS = (LM_LOSS, LM_LOSS_VALIDATION, LM_LOSS_TEST, TOKENS_PER_SECOND_PER_GPU, ITERATION_TIME)
EVENT_FILE_GLOB = "events.out.tfevents.*"
# examples/common.sh's layout: OUTPUT_DIR/{checkpoints,tensorboard,train.log}.
TENSORBOARD_SUBDIRECTORY = "tensorboard"
X_AXES = ("iterations", "tokens", "time")
_EXPERT_LOAD_PATTERN = re.compile(
    re.escape(EXPERT_LOAD_TAG).replace(r"\{layer\}", r"(\d+)").replace(r"\{expert\}", r"(\d+)")
)


class RunEventsError(UserError):
    """A run directory that cannot be read or plotted as asked; the message names it and the fix."""


@dataclass(frozen=True)
class Series:
    """One scalar of a run, one point per iteration: the latest job's, and of a job's the
    first value logged there (after training, the validation split is evaluated once more at
    the last iteration, which an evaluation on schedule may already have logged)."""

    iterations: np.ndarray  # int64 [points]
    values: np.ndarray  # float64 [points]
    seconds: np.ndarray  # float64 [points], wall-clock since the run's first event
    jobs: np.ndarray  # int64 [points], which job logged the point: 0 the first to start


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer's tokens per expert over the mean, 1.0 at perfect balance."""

    iterations: np.ndarray  # int64 [points]
    seconds: np.ndarray  # float64 [points]
    over_mean_EP: np.ndarray  # float64 [experts, points]


@dataclass(frozen=True)
class RunEvents:
    """What a run's event files hold for the plot: its series by scalar name, its MoE layers'
    expert load, the consumed samples at each logged iteration and its sequence length."""

    name: str
    directory: Path  # the directory holding the event files
    series: Dict[str, Series]
    samples_at: Dict[int, int]
    seq_length: Optional[int]
    expert_load: Dict[int, ExpertLoad] = field(default_factory=dict)

    def x_values(self, iterations: np.ndarray, seconds: np.ndarray, axis: str) -> np.ndarray:
        """The points' positions on the x `axis`: iterations, tokens (consumed samples x
        sequence length) or seconds since the run started."""
        if axis == "iterations":
            return iterations.astype(np.float64)
        if axis == "time":
            return seconds
        if axis != "tokens":
            raise RunEventsError(f"--x {axis}: choose one of {', '.join(X_AXES)}")
        if self.seq_length is None:
            raise RunEventsError(
                f"{self.directory}: the event files record no seq_length (runs older than "
                "tools/plot_runs.py do not log their arguments); pass --seq-length for --x tokens"
            )
        missing = [int(i) for i in iterations if int(i) not in self.samples_at]
        if missing:
            raise RunEventsError(
                f"{self.directory}: no consumed-samples scalar ('{LM_LOSS}{SAMPLES_SUFFIX}') at "
                f"iteration {missing[0]}; plot it with --x iterations or --x time"
            )
        samples = np.array([self.samples_at[int(i)] for i in iterations], dtype=np.float64)
        return samples * self.seq_length


def find_event_directory(run_directory: str) -> Path:
    """The directory of a run's event files: `run_directory` itself, or its tensorboard/."""
    path = Path(run_directory)
    if not path.is_dir():
        raise RunEventsError(f"{run_directory}: no such directory; pass a run's output directory")
    for candidate in (path, path / TENSORBOARD_SUBDIRECTORY):
        if candidate.is_dir() and any(candidate.glob(EVENT_FILE_GLOB)):
            return candidate
    raise RunEventsError(
        f"{run_directory}: no TensorBoard event files ({EVENT_FILE_GLOB}) in it or in its "
        f"{TENSORBOARD_SUBDIRECTORY}/; pass the run's --tensorboard-dir or the directory holding it"
    )


def run_name(run_directory: str, event_directory: Path) -> str:
    """The run's label: its directory's name, the parent's when given the tensorboard/ itself."""
    given = Path(run_directory).resolve()
    if event_directory.resolve() == given and given.name == TENSORBOARD_SUBDIRECTORY:
        return given.parent.name
    return given.name


def read_run(run_directory: str, seq_length: Optional[int] = None) -> RunEvents:
    """Read the run under `run_directory` (a run's output directory or its tensorboard/);
    `seq_length` overrides the one its arguments record."""
    directory = find_event_directory(run_directory)
    jobs = _read_jobs(directory)
    start = jobs[0].events.FirstEventTimestamp()
    if not any(LM_LOSS in job.scalar_tags for job in jobs):
        raise RunEventsError(
            f"{directory}: its event files hold no '{LM_LOSS}' scalar (did the run reach its "
            "first --log-interval?)"
        )
    series = {
        tag: _merged_series(jobs, tag, start)
        for tag in SERIES_TAGS
        if any(tag in job.scalar_tags for job in jobs)
    }
    samples_at: Dict[int, int] = {}
    for job in jobs:  # later jobs overwrite the iterations they logged again
        for tag in sorted(job.scalar_tags):
            twin = tag + SAMPLES_SUFFIX
            if twin in job.scalar_tags:
                by_iteration, by_samples = job.events.Scalars(tag), job.events.Scalars(twin)
                if len(by_iteration) == len(by_samples):
                    samples_at.update((a.step, b.step) for a, b in zip(by_iteration, by_samples))
    seq_length_tag = argument_text_tag("seq_length")
    recorded = [job for job in jobs if seq_length_tag in job.tensor_tags]
    if seq_length is None and recorded:
        text = recorded[-1].events.Tensors(seq_length_tag)[-1].tensor_proto.string_val[0]
        seq_length = int(text.decode())
    return RunEvents(
        name=run_name(run_directory, directory),
        directory=directory,
        series=series,
        samples_at=samples_at,
        seq_length=seq_length,
        expert_load=_expert_load(jobs, start),
    )


@dataclass(frozen=True)
class _Job:
    """One event file: what one job of the run logged."""

    events: Any  # tensorboard's EventAccumulator, loaded
    scalar_tags: FrozenSet[str]
    tensor_tags: FrozenSet[str]


def _read_jobs(directory: Path) -> List[_Job]:
    """The directory's event files in the order their jobs started; files without an event (a
    job killed before its writer flushed) are left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    started = []
    for path in sorted(directory.glob(EVENT_FILE_GLOB)):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        try:
            first = events.FirstEventTimestamp()
        except ValueError:
            continue
        tags = events.Tags()
        job = _Job(events, frozenset(tags["scalars"]), frozenset(tags["tensors"]))
        started.append((first, str(path), job))
    if not started:
        raise RunEventsError(
            f"{directory}: its event files ({EVENT_FILE_GLOB}) hold no events; was the run "
            "killed before its first --log-interval?"
        )
    return [job for _, _, job in sorted(started, key=lambda item: item[:2])]


def _merged_series(jobs: List[_Job], tag: str, start: float) -> Series:
    """`tag`'s points over the jobs: a job's first value at each iteration, a later job's
    replacing an earlier job's."""
    points: Dict[int, Tuple[Any, int]] = {}
    for index, job in enumerate(jobs):
        if tag not in job.scalar_tags:
            continue
        first_at: Dict[int, Any] = {}
        for event in job.events.Scalars(tag):
            first_at.setdefault(event.step, event)
        points.update((step, (event, index)) for step, event in first_at.items())
    ordered = [points[step] for step in sorted(points)]
    return Series(
        iterations=np.array([event.step for event, _ in ordered], dtype=np.int64),
        values=np.array([event.value for event, _ in ordered], dtype=np.float64),
        seconds=np.array([event.wall_time - start for event, _ in ordered], dtype=np.float64),
        jobs=np.array([index for _, index in ordered], dtype=np.int64),
    )


def _expert_load(jobs: List[_Job], start: float) -> Dict[int, ExpertLoad]:
    tags_of: Dict[int, Dict[int, str]] = {}
    for tag in frozenset().union(*(job.scalar_tags for job in jobs)):
        match = _EXPERT_LOAD_PATTERN.fullmatch(tag)
        if match:
            layer, expert = int(match.group(1)), int(match.group(2))
            tags_of.setdefault(layer, {})[expert] = tag
    load = {}
    for layer, by_expert in sorted(tags_of.items()):
        rows = [_merged_series(jobs, by_expert[e], start) for e in sorted(by_expert)]
        # Every expert of a layer is logged at the same iterations; keep the ones all have.
        common = sorted(set.intersection(*(set(row.iterations.tolist()) for row in rows)))
        columns = [[int(np.searchsorted(row.iterations, i)) for i in common] for row in rows]
        load[layer] = ExpertLoad(
            iterations=np.array(common, dtype=np.int64),
            seconds=rows[0].seconds[columns[0]],
            over_mean_EP=np.stack([row.values[c] for row, c in zip(rows, columns)]),
        )
    return load
