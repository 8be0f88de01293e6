"""A quiet terminal for a training run: everything the run prints goes to a log file in its run directory; the
terminal shows only the lines meant for users.

While a job runs, this process hosts Ray's driver (and, on a laptop, starts Ray's servers), which print lines a
user cannot act on: C++ core-worker messages, placement-group cleaner tracebacks, token-authentication and
accelerator warnings, the workers' tracebacks before the failure reaches us as one exception. The context
manager redirects file descriptors 1 and 2 (so C++ output and child processes are covered too) into a pipe; a
thread writes every line to ``log_path`` and forwards to the terminal the lines of our own prefixes
(``[pretrain]``, ``[train]``, ...), with Ray's ``(RayTrainWorker pid=N)`` prefix removed. ``PRETRAIN_VERBOSE=1``
shows everything. The CLI prints the summary or the error after the block, with the log's path.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import BinaryIO

_END = b"\x00pretrain-console-end\x00\n"  # written by __exit__: the pump's last line (see there)
_OURS = re.compile(r"^(\[(pretrain|train|fault|grow|prune)\]|error:|warning:)")
_RAY_PREFIX = re.compile(r"^(?:\x1b\[[\d;]*m)?\([\w.:-]+ pid=\d+(?:, ip=[\w.:-]+)?\)(?:\x1b\[0m)? ?")


def user_line(line: str) -> str | None:
    """The line as the terminal shows it (Ray's process prefix removed), or None when it only goes to the log."""
    m = _RAY_PREFIX.match(line)
    body = line[m.end() :] if m else line
    return body if _OURS.match(body) else None


class QuietConsole:
    """``with QuietConsole(path):`` everything written to fd 1 and 2 lands in ``path``; user lines also on the
    terminal (all lines when ``verbose``). ``path`` may be given later (:meth:`set_log`: the run directory exists
    only once the run is created, while Ray already starts); lines until then are held and written first."""

    def __init__(self, log_path: Path | None, verbose: bool | None = None):
        self.log_path = Path(log_path) if log_path is not None else None
        self.verbose = os.environ.get("PRETRAIN_VERBOSE", "") not in ("", "0") if verbose is None else verbose
        self._saved: tuple[int, int] | None = None
        self._write: int | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self._log: BinaryIO | None = None

    def set_log(self, log_path: Path) -> None:
        """Write the lines held so far, and every later line, to ``log_path``."""
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.log_path, self._log = log_path, open(log_path, "ab")
            self._log.write(b"".join(self._held))
            self._log.flush()
            self._held = []

    def __enter__(self) -> QuietConsole:
        if self.log_path is not None:
            self.set_log(self.log_path)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        self._write = write  # kept (not inherited by children) to end the pump: __exit__
        self._thread = threading.Thread(target=self._pump, args=(read,), name="quiet-console", daemon=True)
        self._thread.start()
        return self

    def _pump(self, read: int) -> None:
        assert self._saved is not None  # set by __enter__ before the pump starts
        terminal = self._saved[0]
        with open(read, "rb", buffering=0) as pipe:
            for raw in iter(pipe.readline, b""):
                ended = raw.endswith(_END)
                raw = raw[: -len(_END)] if ended else raw
                with self._lock:
                    if self._log is None:
                        self._held.append(raw)
                    else:
                        self._log.write(raw)
                        self._log.flush()
                line = raw.decode("utf-8", errors="replace")
                shown = line if self.verbose else user_line(line)
                if shown is not None:
                    try:
                        os.write(terminal, shown.encode("utf-8", errors="replace"))
                    except OSError:  # the block has ended and the terminal fd is closed: the log has it
                        pass
                if ended:
                    return

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        assert self._saved is not None and self._write is not None and self._thread is not None  # __enter__ ran
        out, err = self._saved
        os.dup2(out, 1)
        os.dup2(err, 2)
        # The pump ends at this marker, after every line written before it, not at the pipe's end of file: that
        # never comes while anything else holds a copy of the pipe — a child process (a lingering Ray server), or
        # a descriptor a library duplicated and never closed (DeepSpeed's op probe keeps one of stderr) — and
        # every in-process run would wait the 5 s timeout below after its last line.
        os.write(self._write, _END)
        os.close(self._write)
        self._thread.join(timeout=5)
        os.close(out)
        os.close(err)
        if not self._thread.is_alive() and self._log is not None:  # else the pump still writes to it
            self._log.close()
