"""The exception a signal raises while zeroplan writes a file (``files.py _signals_held``), in a module of its own
so that the command line's one-line error handler (``cli_options.OneLineErrors``) can name it without importing
``files.py`` (``tempfile``, ``threading``) on the paths that write nothing."""

from __future__ import annotations

import signal


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a file was being written (the temporary file is already gone)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
