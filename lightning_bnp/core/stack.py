"""Where BNP's warnings point: the first line outside the ``lightning_bnp`` package (the user's, or Lightning's)."""

from __future__ import annotations

import os
import sys

__all__ = ["user_stacklevel"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function that names the first frame
    outside the ``lightning_bnp`` package — the user's line (or Lightning's), however deep inside BNP the warning
    is raised (``pre.step()`` → ``precondition`` → …, or a constructor wrapped by ``ArgumentsRepr``)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
