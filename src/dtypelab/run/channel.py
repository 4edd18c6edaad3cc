"""The one channel between a launcher and its workers, whatever they are: a child process, the ranks torchrun
starts, a user's script. The launcher listens on a Unix socket (``Channel``) and names it in the worker's environment
(``DTYPELAB_CHANNEL``, with a key); every worker process connects (``connect``), is sent its work, and sends back
messages (``run.messages``): ``Started`` first, then ``Step``, a capability's own ``Note`` (a script session's record),
and at the end ``Done`` with the value or ``Failed`` with why.

A socket rather than a pipe inherited by file descriptor: torchrun closes inherited descriptors when it starts its
ranks, and a user's script is its own program; an environment variable reaches both. Messages are pickled
(``multiprocessing.connection``), so whatever the user's code prints cannot corrupt them.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from dtypelab.run.messages import Failed, Message, Note, Started, Step

ENV_CHANNEL = "DTYPELAB_CHANNEL"
ENV_KEY = "DTYPELAB_CHANNEL_KEY"
PROGRESS_EVERY_S = 0.1  # a worker's step messages are throttled to this


class Channel:
    """The launcher's end: accepts every worker that connects, sends each ``payload``, and queues their messages.
    Use as a context manager; ``env`` goes into the workers' environment."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        # a short path: Unix socket addresses are limited to ~100 bytes
        self._dir = tempfile.mkdtemp(prefix="dtl-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.address = os.path.join(self._dir, "c")
        self._key = os.urandom(16)
        self._listener = Listener(self.address, "AF_UNIX", authkey=self._key)
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._open = 0  # connections whose reader has not seen the end
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        return {ENV_CHANNEL: self.address, ENV_KEY: self._key.hex()}

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # closed, or a client that failed the handshake
                if self._closed:
                    return
                continue
            with self._lock:
                self._open += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            conn.send(self.payload)
            while True:
                self.inbox.put(conn.recv())
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a message that does not unpickle here: say so rather than hang
            self.inbox.put(Failed("failed", f"a worker's message could not be read: {exc}"))
        finally:
            conn.close()
            with self._lock:
                self._open -= 1

    def get(self, timeout: float) -> Message | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self, timeout: float = 2.0) -> list[Message]:
        """Every message still on its way once the workers have exited (their readers reach the end)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if self._open == 0:
                    break
            time.sleep(0.01)
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launched() -> bool:
    """Whether a launcher started this program (named a channel in its environment); ``connect`` would connect."""
    return bool(os.environ.get(ENV_CHANNEL) and os.environ.get(ENV_KEY))


def connect(rank: int = 0) -> tuple[Connection, Any] | None:
    """The worker's end: (the connection, the work or payload it was sent), or None when no launcher named a
    channel (the program runs on its own)."""
    address, key = os.environ.get(ENV_CHANNEL), os.environ.get(ENV_KEY)
    if not address or not key:
        return None
    conn = Client(address, "AF_UNIX", authkey=bytes.fromhex(key))
    conn.send(Started(os.getpid(), rank))
    try:
        return conn, conn.recv()
    except Exception as exc:  # its class does not import here (another environment, a missing path)
        hint = (" (a kind or task the running script defines: keep the script's own work under if __name__ == "
                "'__main__': so that a worker can import it, or define it in a module of its own)"
                if isinstance(exc, AttributeError) and "Can't get attribute" in str(exc) else "")
        conn.send(Failed("failed", f"the worker could not load its work: {type(exc).__name__}: {exc}{hint}", rank))
        raise


def watch_parent() -> None:
    """Exit this process when its parent dies (nobody would read its result, and it must not be orphaned)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


class Reporter:
    """What a worker's work reports through: steps (throttled), notices, and a capability's own messages."""

    def __init__(self, conn: Connection | None = None, rank: int = 0, on_step: Any = None) -> None:
        self.conn, self.rank, self._on_step = conn, rank, on_step
        self._last = 0.0

    def step(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < PROGRESS_EVERY_S and done != total:
            return
        self._last = now
        if self._on_step is not None:
            self._on_step(done, total)
        elif self.conn is not None and self.rank == 0:
            self.conn.send(Step(done, total))

    def send(self, kind: str, *payload: Any) -> None:
        """A capability's own message (``Note``)."""
        if self.conn is not None:
            self.conn.send(Note(kind, payload))

    def __call__(self, done: int, total: int) -> None:  # a Reporter is also a progress callback
        self.step(done, total)
