"""Where generated games and derived data (vocabularies, demonstrations) live: never in git.

``$GYRE_CACHE`` if set, else ``$XDG_CACHE_HOME/gyre``, else ``~/.cache/gyre``.
"""

from __future__ import annotations

import os


def cache_dir(*parts: str) -> str:
    """The cache directory (created), or a sub-directory of it."""
    root = os.environ.get("GYRE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gyre")
    path = os.path.join(root, *parts)
    os.makedirs(path, exist_ok=True)
    return path
