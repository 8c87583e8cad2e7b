"""The ``gyre`` command line: one module per group of commands."""

from gyre_async.cli.main import main

__all__ = ["main"]
