"""Start-up refusals a user can fix: what is wrong and the setting or command that fixes it.

``mlpair serve-*`` prints a :class:`StartupError` as one line on stderr and exits 2 (a
configuration error); any other start-up failure exits 1. Tracebacks appear only with ``--debug``.
"""

from __future__ import annotations


class StartupError(Exception):
    """A configuration or environment problem found before serving (port in use, no model repository,
    CUDA asked for but not active). The message is one line: the problem, then the fix."""
