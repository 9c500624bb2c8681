"""How a ``zeroplan`` process ends. A one-answer command (``ONE_ANSWER``, and help) run as the process's command
(the console script, ``python -m zeroplan.cli``) ends once its answer is written, as the interpreter would end it
but without the teardown of every object it made (docs/benchmarks.md, "2026-12-03, fifth session, startup3"). Kept
out of ``cli`` (full) beside it. A speed-up, no rule."""

import atexit
import os
import sys
from collections.abc import Callable

ONE_ANSWER = ("estimate", "plan")  # and help: no cyclic collector (docs/benchmarks.md, third pass)


def one_answer(args: list[str]) -> bool:
    """``args`` (the command line after ``zeroplan``) ask for one answer: ``ONE_ANSWER``'s commands, or help (no
    command, or ``--help``). ``zeroplan.cli.main`` runs them without the cyclic collector and ends them frozen."""
    return not args or args[0] in ONE_ANSWER or "--help" in args


def ended(main: Callable[[], None]) -> None:
    """``main()`` as the process's command; a one-answer command's process then ends with ``os._exit``, after what
    the interpreter's own exit does that can be seen: no thread of its own left running (else the interpreter's exit,
    which waits for it), ``atexit``'s functions run, stdout and stderr flushed (a flush that fails: the interpreter's
    exit, which reports it), the exit code of its ``SystemExit`` (None or an int; anything else: the interpreter's,
    which prints it). What is skipped is the teardown: every module's objects freed one by one, about 11 M
    instructions and 5-20 CPU-ms of the FSDP2 Llama-2-70B plan on 2,048 GPUs (memory handed back object by object).
    These commands write stdout alone (their files, the code cache, are closed). Another command, ``python -i``, and
    a ``main`` that returns end as before."""
    try:
        main()
    except SystemExit as done:
        code = done.code
        if (code is None or type(code) is int) and one_answer(sys.argv[1:]) and not sys.flags.inspect and _quiet():
            os._exit(code or 0)
        raise


def _quiet() -> bool:
    """The interpreter's exit before its teardown: True once no other thread runs, ``atexit``'s functions have run
    (each error reported by ``atexit``, as at exit; they run once) and stdout and stderr are flushed."""
    threading = sys.modules.get("threading")
    if threading is not None and any(t is not threading.main_thread() and not t.daemon and t.is_alive()
                                     for t in threading.enumerate()):
        return False
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        return False
    return True


def ending(main: Callable[[], None]) -> Callable[[], None]:
    """The process's command: ``main`` (``zeroplan.cli.main``), then ``ended``; ``zeroplan.cli.command``, the console
    script (pyproject.toml) and ``python -m zeroplan.cli``."""

    def command() -> None:
        ended(main)

    return command
