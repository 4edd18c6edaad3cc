"""A warm parent for child-process workers: ``python -m dtypelab.run.zygote`` imports torch once, then forks one
worker per request, so each policy's process starts in milliseconds instead of paying Python's start-up and torch's
import again (about 2 s each on a 2-core CPU, more with torchao and transformers, which it also keeps once a worker
has used them).

Why forking is safe here: the zygote only imports. It runs no torch op, so no OpenMP or intra-op thread pool exists
to be broken by ``fork``; it starts no thread; it never touches CUDA (CUDA work runs in fresh processes, see
``ProcessLauncher``). Each worker starts a session of its own (so it and what it starts stop together), writes
to its own log, and takes the launcher's environment and working directory of the moment.

A user's training script can start here too (``argv``): it then runs as ``python -m dtypelab.run.boot SCRIPT ARGS``
would run it, down to its exit code, its ``atexit`` hooks and its threads joined on the way out.

Protocol, one line each way: the launcher writes a JSON request (``env``, ``cwd``, ``log``, ``preload``, and
``argv`` for a script) on the zygote's stdin; the zygote answers ``pid N`` once the worker exists and ``exit CODE``
when it has ended (a negative code: the signal that ended it, as ``subprocess`` reports it). A request with
``warm`` only imports its ``preload`` (answered ``warm``): the launcher starts the zygote early that way. Its stdin
closing (the launcher gone) ends the zygote and any worker still running.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

POLL_S = 0.05
# read at run time, not at import (the terminal's size; pytest's name of the test running, new at every test), or
# written by torch itself once imported (inductor's cache folder, its default): a change in these does not make the
# zygote's imports stale
RUN_TIME_ENV = ("COLUMNS", "LINES", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
READY_TIMEOUT_S = 120.0  # importing torch on a loaded 2-core machine can take tens of seconds


# --- the zygote's side -----------------------------------------------------------------------------------------
def _reply(text: str) -> None:
    os.write(1, (text + "\n").encode())


def _child(req: dict[str, Any]) -> None:
    """In the forked worker: its own session, log, directory and environment; then the worker's main, or with
    ``argv`` a user's script run as ``python -m dtypelab.run.boot ARGV`` runs it. Never returns."""
    code = 1
    script = "argv" in req
    try:
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if script:
            from dtypelab.run import boot

            signal.signal(signal.SIGINT, _SCRIPT_SIGINT)  # what a fresh interpreter started here would have
            sys.argv = ["-m", *req["argv"]]
            boot.main()
            code = 0
        else:
            from dtypelab.run import worker

            code = worker.main()
    except SystemExit as exc:  # as the interpreter ends on it: None is success, a message is printed and fails
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        if script:  # what an interpreter does on its way out: wait for the script's threads, run its atexit hooks
            with contextlib.suppress(BaseException):
                threading._shutdown()  # type: ignore[attr-defined]
            with contextlib.suppress(BaseException):
                atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


_PENDING = bytearray()  # what stdin brought that no request has taken yet (a request may come while a worker runs)


def _wait(pid: int) -> int | None:
    """The worker's exit code, or None when the launcher went away first (the worker is then killed). A request that
    comes meanwhile is kept for after it."""
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # EOF: nobody will read the result
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            _PENDING.extend(chunk)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)


def _requests():
    """Request lines from stdin until it closes (read unbuffered, so ``select`` sees what is pending)."""
    while True:
        while b"\n" not in _PENDING:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            _PENDING.extend(chunk)
        end = _PENDING.index(b"\n")
        line = bytes(_PENDING[:end])
        del _PENDING[:end + 1]
        yield json.loads(line)


# Python installs its KeyboardInterrupt handler at start-up unless SIGINT came in ignored (a job started in the
# background, nohup): a fresh interpreter the launcher starts inherits that, and so does a script forked from here
_SCRIPT_SIGINT = signal.default_int_handler


def main() -> int:
    global _SCRIPT_SIGINT
    _SCRIPT_SIGINT = signal.getsignal(signal.SIGINT)
    if _SCRIPT_SIGINT is not signal.SIG_IGN:
        _SCRIPT_SIGINT = signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and closes our stdin
    import torch  # noqa: F401  -- the point of this process

    from dtypelab.core.backends import quiet

    _reply("ready")
    for req in _requests():
        for name in req.get("preload", ()):
            # the worker will say what is wrong, in its own log; a library's import-time noise (torchao's kernels
            # built for another GPU, torch's deprecation warnings) is not the user's to read
            with contextlib.suppress(Exception), quiet():
                importlib.import_module(name)
        if req.get("warm"):  # the imports alone, ahead of the first worker, while the launcher does its own work
            _reply("warm")
            continue
        gc.collect()
        gc.freeze()  # the inherited objects stay out of the worker's collections: none of their pages copied
        pid = os.fork()
        if pid == 0:
            _child(req)
        _reply(f"pid {pid}")
        code = _wait(pid)
        if code is None:
            return 0
        _reply(f"exit {code}")
    return 0


# --- the launcher's side ---------------------------------------------------------------------------------------
class Zygote:
    """The launcher's handle on its zygote: started on first use, started again when the environment or directory a
    worker would import under has changed (or the zygote died), closed with the launcher's process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._key: tuple[Any, ...] | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self.warm: set[str] = set()  # heavy libraries a worker imported: loaded in the zygote before the next one
        self._owed: list[str] = []  # the replies due before the next request's (``_settle``)
        self._forked = False

    @staticmethod
    def _import_key() -> tuple[Any, ...]:
        # what decides how modules import: the interpreter, the directory, and the environment (dtypelab's own
        # settings and RUN_TIME_ENV are not)
        env = tuple(sorted((k, v) for k, v in os.environ.items()
                           if not k.startswith("DTYPELAB_") and k not in RUN_TIME_ENV))
        return sys.executable, os.getcwd(), env

    def _spawn(self) -> None:
        """The zygote's process, started; its "ready" is read before the first request's answer (``_settle``)."""
        self.close()
        log = os.path.join(tempfile.gettempdir(), f"dtypelab-zygote-{os.getpid()}.log")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "dtypelab.run.zygote"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=out, cwd=os.getcwd(),
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self._key, self._buf, self.warm, self._owed = self._import_key(), b"", set(), ["ready"]
        self._forked = False  # whether it has forked a worker (which closing it must let it end)

    def _settle(self) -> None:
        """Read the replies owed before the next one (its "ready", and "warm" for each ``begin``); the end of a
        worker nobody waited for (its launcher gave up on it) is passed over."""
        while self._owed:
            line = self._line(READY_TIMEOUT_S)
            if line is not None and line.startswith("exit "):
                continue
            if line != self._owed.pop(0):
                self.close()
                raise OSError(f"the worker zygote did not start ({line or 'no answer'})")

    def _started(self) -> None:
        if self.proc is None or self.proc.poll() is not None or self._key != self._import_key():
            self._spawn()

    def _send(self, req: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def begin(self, preload: tuple[str, ...]) -> None:
        """Start the zygote now and have it import ``preload`` (libraries, dtypelab's job modules) while the caller
        goes on: the first worker then forks from a zygote that has them. Returns at once."""
        with self._lock:
            self._started()
            self._send({"warm": True, "preload": list(preload)})
            self._owed.append("warm")

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next reply line; None when none came in ``timeout`` or the zygote has gone."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            wait = None if end is None else max(0.0, end - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def fork(self, env: dict[str, str], log: str, preload: tuple[str, ...] = (),
             argv: list[str] | None = None) -> Forked:
        """A worker forked from the zygote, with ``env`` and the current directory, its output to ``log``; with
        ``argv`` (a script and its arguments), that script run as ``dtypelab.run.boot`` runs it."""
        with self._lock:
            self._started()
            self._settle()
            req = {"env": env, "cwd": os.getcwd(), "log": log, "preload": [*preload, *sorted(self.warm)]}
            if argv is not None:
                req["argv"] = argv
            self._send(req)
            reply = self._line(READY_TIMEOUT_S)
            if not reply or not reply.startswith("pid "):
                self.close()
                raise OSError(f"the worker zygote did not fork a worker ({reply or 'no answer'})")
            self._forked = True
            return Forked(self, int(reply.split()[1]))

    def close(self) -> None:
        if self.proc is not None:
            if self._owed and not self._forked and self.proc.poll() is None:
                # still importing (started early, its answers unread), no worker forked: nothing to wait for, and a
                # command that stops on bad input should not wait for its imports
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                if self.proc.stdin is not None:
                    self.proc.stdin.close()  # the zygote ends, and any worker with it
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


class Forked:
    """A forked worker as ``Watch`` follows a process: ``pid``, ``poll``, ``wait``, ``returncode`` (its exit code
    comes from the zygote, its parent)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def _ended(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        line = self.zygote._line(timeout)
        if line is not None and line.startswith("exit "):
            self.returncode = int(line.split()[1])
            return True
        if line is None and (self.zygote.proc is None or self.zygote.proc.poll() is not None):
            self.returncode = -signal.SIGKILL  # the zygote itself died, and its worker with it
            return True
        return False

    def poll(self) -> int | None:
        self._ended(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


if __name__ == "__main__":
    sys.exit(main())
