"""The read side of the log: replay, inspection, invariants, archive, and what a run's events say."""
