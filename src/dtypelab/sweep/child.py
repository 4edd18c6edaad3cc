"""The child process of a ProcessLauncher: ``python -m dtypelab.sweep.child FD`` reads one pickled job on
stdin, runs it, and sends progress and the result over the pipe FD. Never imported by the package (running
it with -m would otherwise import it twice)."""

from __future__ import annotations

import pickle
import signal
import sys
import time
from multiprocessing.connection import Connection

from dtypelab.sweep.launch import PROGRESS_EVERY_S, execute, watch_parent


def _child_main(fd: int) -> None:
    # The parent handles Ctrl-C and terminates us; a KeyboardInterrupt traceback here is noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()
    job = pickle.loads(sys.stdin.buffer.read())
    conn = Connection(fd, readable=False)
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S or done == total:
            last = now
            conn.send(("step", done, total))

    conn.send(("result", execute(job, progress)))
    conn.close()


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
