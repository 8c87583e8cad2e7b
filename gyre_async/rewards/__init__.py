"""Reward arbitration: guards, verifiable outcome and milestones, rules, process model.

The arbiter actor (``actors/arbiter.py``) is a thin shell over
:class:`~gyre_async.rewards.arbitration.Arbitration`; the precedence levels are documented
there, the guard definitions in :mod:`.guards`, rule rewards in :mod:`.rules` and the
process reward model (with its labels and weights formats) in :mod:`.prm`.
"""
