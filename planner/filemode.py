"""File modes as a plain open()/mkdir() gives them, for files staged through mkstemp/mkdtemp (0600/0700)."""

from __future__ import annotations

import os


def permissions(mode: int) -> int:
    """`mode` less the process umask: what open()/mkdir() would give."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask
