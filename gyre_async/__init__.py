"""Gyre runtime: event bus, actor runtime, stores, config, CLI and the library pieces actors use."""

__version__ = "0.1.0"
