"""The read models: projections of the event log, each an ``apply(event)`` fold (run
progress, credit, redelivery, lag, pacing, a role's restart state). Below the runtime and
the actors, above ``bus/`` and ``rl/``; ``audit/`` holds the tools that use them."""
