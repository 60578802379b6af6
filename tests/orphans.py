"""Processes started by the tests that die with the test run.

pytest-timeout ends a hung run with ``os._exit`` (``timeout_method = "thread"``):
no fixture is torn down, so the Redis servers, Celery workers and gunicorn
arbiters the tests started would run on, holding their ports, consuming their
queues and the CPU of the next run. On Linux, a command started through
:func:`dying_with_this_process` asks the kernel first (``PR_SET_PDEATHSIG``, which
survives the ``exec``) to SIGKILL it when the process that started it ends; it then
*is* the command (same pid), so the tests still signal and wait for it directly.

Start such commands from the main thread: the kernel ties the signal to the thread
that forked, and kills the command when that thread ends.

    python -I -S tests/orphans.py <pid of the starting process> <command...>
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def dying_with_this_process(command):
    """``command`` (an argument list) as run through this module, so that it is
    SIGKILLed when this process ends; ``command`` itself where that is not
    available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    # By path, isolated and without site: any working directory, a quick start.
    return [sys.executable, "-I", "-S", __file__, str(os.getpid()), *command]


def main(argv):
    parent, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the request: nobody to outlive
        os._exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
