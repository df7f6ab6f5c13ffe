"""The error a bad command line raises, and how a flag is spelled in it."""

from __future__ import annotations


class ConfigError(ValueError):
    """An impossible or unsupported command line, reported before any work starts."""


def flag_name(name: str) -> str:
    """The command-line spelling of a namespace attribute."""
    return "--DDP-impl" if name == "DDP_impl" else "--" + name.replace("_", "-")
