"""Gyre: online RL of LLM agents on very long tasks, as an event-sourced actor system.

Subpackages, in the direction of imports (``schemas`` is the wire contract below all):

- ``bus/``      the Bus interface, the embedded SQLite-WAL backend, Kafka, the one log reader
- ``storage/``  Zarr segment store, content-addressed checkpoints, atomic writes
- ``envs/``     environment API, the built-in long-horizon family, adapters (each owns its words)
- ``policy/``   tokenizers, bounded contexts, torch / Hugging Face / vLLM backends
- ``rl/``       maths only: advantages, PPO, fusion, critic guards, staleness rule
- ``rewards/``  guards, milestones, rules, process reward model, drift
- ``experience/`` elite pool and retention of segments
- ``core/``     the pure cores of the roles, testable without a bus
- ``runtime/``  actor runner, topology, in-process loop, launcher, metrics
- ``audit/``    the read side of the log: replay, inspect, invariants, archive, the run fold
- ``ui/``       live monitor and HTML report
- ``offline/``  demonstrations, warm-start, export
- ``cli/``      the ``gyre`` command

Foundations used everywhere: ``config`` (TOML -> typed config), ``errors`` (retriable
flag), ``imports`` (configured plug-in targets), ``timing`` (busy-time counters),
``faultpoints`` (named pause points for chaos tests).
"""

__version__ = "0.1.0"
