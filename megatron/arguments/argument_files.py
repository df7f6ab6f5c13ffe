"""`@FILE` on the command line: the flags written in FILE, read as Megatron-Core users write them.

    pretrain_gpt.py @model.args @data.args --train-iters 1000

A file holds any number of flags per line, split as a shell splits them (quotes keep a value with
spaces whole) and with `#` starting a comment; blank lines are skipped and a file may name another
`@FILE`. Flags keep their command-line order, so a flag after `@FILE` overrides the file's. A
relative FILE is read from the working directory, as argparse reads it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import List, NoReturn, Optional, Sequence, Tuple

ARGUMENT_FILE_PREFIX = "@"


class ArgumentFileParser(argparse.ArgumentParser):
    """argparse.ArgumentParser that expands `@FILE`; with `exit_on_error=False` every error is an
    ArgumentError, a missing file's included (argparse itself exits there)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("fromfile_prefix_chars", ARGUMENT_FILE_PREFIX)
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None
    ) -> Tuple[argparse.Namespace, List[str]]:
        """argparse's, after checking that each `@FILE` of `args` is a file: argparse's own
        message for one that is not does not say it was an argument file."""
        args = sys.argv[1:] if args is None else list(args)
        for arg in args:
            if arg.startswith(ARGUMENT_FILE_PREFIX) and not os.path.isfile(arg[1:]):
                self.error(
                    f"argument file {arg}: {os.path.abspath(arg[1:])} is not a file; check the "
                    "path (a relative one is read from the working directory)"
                )
        return super().parse_known_args(args, namespace)

    def convert_arg_line_to_args(self, arg_line: str) -> List[str]:
        """One line of an argument file: its shell words, without a `#` comment."""
        try:
            return shlex.split(arg_line, comments=True)
        except ValueError as error:  # an unclosed quote
            self.error(f"argument file line {arg_line!r}: {error}; close its quotation")

    def error(self, message: str) -> NoReturn:
        """Exit with argparse's usage and message, or raise it when errors should not exit."""
        if self.exit_on_error:
            super().error(message)
        raise argparse.ArgumentError(None, message)
