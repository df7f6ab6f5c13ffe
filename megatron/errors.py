"""The error a user can fix: what pretrain_gpt.py reports as one line before exiting with 1.

Flag problems found before any work are `megatron.config.ConfigError` (exit 2, argparse's
convention). Problems found while setting up or running, that the user causes and can fix
(a damaged or mismatched checkpoint, a dataset that cannot serve the run, a save directory that
is full or not writable), are `UserError`s: the entry point prints `error: <message>` and
exits 1 instead of showing a traceback (MEGATRON_TRACEBACK=1 shows it).
"""

from __future__ import annotations

import os


class UserError(Exception):
    """A run cannot go on because of its inputs; the message says what, where and what to do."""


class TrainingDiverged(UserError):
    """A non-finite loss, gradient norm or weight (--check-for-nan-in-loss-and-grad): the run
    stops at that iteration, before anything of it is saved."""


def traceback_asked() -> bool:
    """MEGATRON_TRACEBACK=1: the errors an entry point reports in one line raise instead."""
    return os.environ.get("MEGATRON_TRACEBACK", "0") not in ("", "0")
