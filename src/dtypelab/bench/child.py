"""The child process of a ProcessLauncher: ``python -m dtypelab.bench.child FD`` reads one pickled job on
stdin, runs it, and sends progress and the result over the pipe FD. Never imported by the package (running
it with -m would otherwise import it twice)."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from dtypelab.bench.launch import PROGRESS_EVERY_S, execute


def _exit_with_parent() -> None:
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:  # the parent died: nobody will read our result
            os._exit(1)


def _child_main(fd: int) -> None:
    # The parent handles Ctrl-C and terminates us; a KeyboardInterrupt traceback here is noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
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
