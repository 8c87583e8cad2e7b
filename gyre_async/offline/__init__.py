"""Offline data: demonstrations, warm-start (behaviour cloning) and export of good trajectories."""
