"""``python -m dtypelab.run.worker``: the process a child-process or torchrun launcher starts. It connects to the
channel named in its environment, is sent its work, runs it, and sends back ``Done(value, rank)`` or
``Failed(status, reason, rank)`` (a torchrun rank's reason names its rank; ``run.messages``). A worker forked from
the zygote (``dtypelab.run.zygote``) runs the same ``main``."""

from __future__ import annotations

import os
import signal
import sys

from dtypelab.run.channel import Reporter, connect, watch_parent
from dtypelab.run.messages import Done, Failed, Note
from dtypelab.run.outcome import failure
from dtypelab.run.warm import heavy_modules


def main() -> int:
    # The launcher handles Ctrl-C and stops us; a KeyboardInterrupt traceback here is noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()  # a launcher (or torchrun) that dies must not leave us running
    rank = int(os.environ.get("RANK", "0"))
    connected = connect(rank)
    if connected is None:
        print("dtypelab.run.worker is started by a dtypelab launcher, not by hand", file=sys.stderr)
        return 2
    conn, work = connected
    try:
        value = work(Reporter(conn, rank))
    except BaseException as exc:  # every failure (SystemExit included) becomes this worker's one line
        status, reason = failure(exc)
        conn.send(Failed(status, f"rank {rank}: {reason}" if "WORLD_SIZE" in os.environ else reason, rank))
        return 1
    # heavy libraries the work imported: a zygote loads them before it forks the next worker
    conn.send(Note("modules", (heavy_modules(),)))
    conn.send(Done(value, rank))
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
