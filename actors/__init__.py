"""One module per role; each is a thin adapter over a pure core."""
