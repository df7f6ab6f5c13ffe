"""A training run's TensorBoard event files read back: the scalars tools/plot_runs.py draws,
against iterations, tokens or wall-clock time.

What the trainer writes with --tensorboard-dir (megatron.training.logging.TensorBoardLogger,
rank 0 only) and what is read here:
- `lm loss` and `throughput/tokens-per-second-per-gpu` at every --log-interval, `lm loss
  validation` at every evaluation, each also as `... vs samples`, the same values with the
  consumed samples as their step. Pairing a scalar's events with its `vs samples` twin gives the
  consumed samples at each iteration (with a batch-size ramp-up they are not proportional).
- the run's arguments as text (Megatron's write_args_to_tensorboard): `seq_length` turns
  consumed samples into tokens.
- with MoE layers, each expert's tokens over its layer's mean at every --log-interval
  (moe.expert_load.EXPERT_LOAD_TAG).

Reading uses tensorboard's own EventAccumulator, every point kept. Its purge of orphaned data
drops what a run logged past the checkpoint it resumed from, so a resumed run reads as one.
Wall-clock time counts from the first event of the directory (written when the trainer
started), so it includes start-up, and for a resumed run the time between its jobs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from megatron.errors import UserError
from megatron.training.logging import (
    SAMPLES_SUFFIX,
    TOKENS_PER_SECOND_PER_GPU,
    VALIDATION_SUFFIX,
    argument_text_tag,
)
from moe.expert_load import EXPERT_LOAD_TAG

LM_LOSS = "lm loss"  # megatron.composition.forward_step's reported loss
LM_LOSS_VALIDATION = LM_LOSS + VALIDATION_SUFFIX
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
    """One scalar of a run, one point per iteration (the first value logged there: Megatron
    logs the end-of-training test loss under the validation name, at the same iteration)."""

    iterations: np.ndarray  # int64 [points]
    values: np.ndarray  # float64 [points]
    seconds: np.ndarray  # float64 [points], wall-clock since the run's first event


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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory = find_event_directory(run_directory)
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    start = events.FirstEventTimestamp()
    tags = events.Tags()
    scalar_tags = set(tags["scalars"])
    if LM_LOSS not in scalar_tags:
        raise RunEventsError(
            f"{directory}: its event files hold no '{LM_LOSS}' scalar (did the run reach its "
            "first --log-interval?)"
        )
    series = {
        tag: _series(events.Scalars(tag), start)
        for tag in (LM_LOSS, LM_LOSS_VALIDATION, TOKENS_PER_SECOND_PER_GPU)
        if tag in scalar_tags
    }
    samples_at: Dict[int, int] = {}
    for tag in sorted(scalar_tags):
        twin = tag + SAMPLES_SUFFIX
        if twin in scalar_tags:
            by_iteration, by_samples = events.Scalars(tag), events.Scalars(twin)
            if len(by_iteration) == len(by_samples):
                samples_at.update((a.step, b.step) for a, b in zip(by_iteration, by_samples))
    if seq_length is None and argument_text_tag("seq_length") in tags["tensors"]:
        text = events.Tensors(argument_text_tag("seq_length"))[-1].tensor_proto.string_val[0]
        seq_length = int(text.decode())
    return RunEvents(
        name=run_name(run_directory, directory),
        directory=directory,
        series=series,
        samples_at=samples_at,
        seq_length=seq_length,
        expert_load=_expert_load(events, scalar_tags, start),
    )


def _series(scalar_events: List, start: float) -> Series:
    first_at: Dict[int, object] = {}
    for event in scalar_events:
        first_at.setdefault(event.step, event)
    points = [first_at[step] for step in sorted(first_at)]
    return Series(
        iterations=np.array([event.step for event in points], dtype=np.int64),
        values=np.array([event.value for event in points], dtype=np.float64),
        seconds=np.array([event.wall_time - start for event in points], dtype=np.float64),
    )


def _expert_load(events, scalar_tags, start: float) -> Dict[int, ExpertLoad]:
    tags_of: Dict[int, Dict[int, str]] = {}
    for tag in scalar_tags:
        match = _EXPERT_LOAD_PATTERN.fullmatch(tag)
        if match:
            layer, expert = int(match.group(1)), int(match.group(2))
            tags_of.setdefault(layer, {})[expert] = tag
    load = {}
    for layer, by_expert in sorted(tags_of.items()):
        rows = [_series(events.Scalars(by_expert[e]), start) for e in sorted(by_expert)]
        # Every expert of a layer is logged at the same iterations; keep the ones all have.
        common = sorted(set.intersection(*(set(row.iterations.tolist()) for row in rows)))
        columns = [[int(np.searchsorted(row.iterations, i)) for i in common] for row in rows]
        load[layer] = ExpertLoad(
            iterations=np.array(common, dtype=np.int64),
            seconds=rows[0].seconds[columns[0]],
            over_mean_EP=np.stack([row.values[c] for row, c in zip(rows, columns)]),
        )
    return load
