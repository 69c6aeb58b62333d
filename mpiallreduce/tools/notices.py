"""Open MPI's notices in a launch's output that tell the user nothing the ranks have not told.

    ranks ──(stdout, stderr)── mpiexec ──(two pipes)── NoticeFilter ── the launcher's stdout, stderr

What is left out, and only that:
- PRRTE's ``plm:ssh: Warning: setpgid(P,P) failed in parent with errno=Permission denied(13)``:
  printed unconditionally (plm_ssh_module.c) when the parent's setpgid of a daemon's launch agent
  loses the race with the child's own setpgid and exec (EACCES), which every ``--nodes`` launch may
  do; the child is in its process group either way;
- the ``MPI_ABORT was invoked ...`` notice and prterun's "has exited due to process rank ... calling
  abort" or "exited with non-zero status", once a rank has said why the job ends
  (``mpiallreduce: ... aborting the MPI job``: its traceback, or its ``sys.exit(n)``; see
  mpiallreduce.faults.aborting). Without such a line they stay: then they are the only explanation.

A notice is the block between two lines of 74 dashes (Open MPI's show_help). ``mpiallreduce launch
--mpi-notices`` shows everything.
"""
import os
import re
import threading

__all__ = ["NoticeFilter", "filter_text", "pump"]

RULE = "-" * 74
#: a notice longer than this is not one of Open MPI's: pass it on as it came
MAX_NOTICE_LINES = 40
HARMLESS_LINES = (
    re.compile(r"^\[[^\]]*\] plm:ssh: Warning: setpgid\(\d+,\d+\) failed in parent with errno=Permission denied\(13\)$"),
)
#: what a rank prints before it aborts the job (faults/aborting.py): the job's end is explained
RANKS_SAID_WHY = re.compile(r"mpiallreduce: .*aborting the MPI job")
EXPLAINED_NOTICES = ("MPI_ABORT was invoked on rank", "has exited due to process rank",
                     "exited with non-zero status")


class NoticeFilter:
    """Filters one stream line by line; streams of one launch share ``said_why`` (a one-item list)."""

    def __init__(self, said_why=None, show_all=False):
        self.said_why = [False] if said_why is None else said_why
        self.show_all = show_all
        self.block = None  # the lines of a notice being read

    def feed(self, line):
        """The lines to write now, given one line (with its newline, if it has one)."""
        if self.show_all:
            return [line]
        text = line.rstrip("\r\n")
        if RANKS_SAID_WHY.search(text):
            self.said_why[0] = True
        if self.block is not None:
            self.block.append(line)
            if text == RULE:
                return self._close()
            if len(self.block) > MAX_NOTICE_LINES:
                return self.flush()
            return []
        if text == RULE:
            self.block = [line]
            return []
        if any(pattern.match(text) for pattern in HARMLESS_LINES):
            return []
        return [line]

    def _close(self):
        block, self.block = self.block, None
        body = "".join(block)
        if self.said_why[0] and any(phrase in body for phrase in EXPLAINED_NOTICES):
            return []
        return block

    def flush(self):
        """What is held back (an unfinished notice), at the end of the stream."""
        block, self.block = self.block or [], None
        return block


def filter_text(text, show_all=False):
    """``text`` (a launch's captured output) without the notices above."""
    notices = NoticeFilter(show_all=show_all)
    kept = [piece for line in text.splitlines(keepends=True) for piece in notices.feed(line)]
    return "".join(kept + notices.flush())


def pump(source, destination, notices):
    """A thread copying binary file ``source`` (a pipe) to binary file ``destination`` through
    ``notices``. A partial line that is not the start of a notice or a known line is written at
    once (a prompt without its newline is not held back)."""

    def copy():
        pending = ""
        written = False  # part of the pending line went out already: the rest follows unfiltered
        while True:
            chunk = os.read(source.fileno(), 65536)
            if not chunk:
                break
            lines = (pending + chunk.decode("utf-8", "replace")).splitlines(keepends=True)
            pending = lines.pop() if lines and not lines[-1].endswith("\n") else ""
            out = []
            for line in lines:
                out += [line] if written else notices.feed(line)
                written = False
            if pending and notices.block is None and not pending.startswith(("-", "[")):
                out.append(pending)
                pending, written = "", True
            if out:
                destination.write("".join(out).encode())
                destination.flush()
        out = notices.flush() + ([pending] if pending else [])
        if out:
            destination.write("".join(out).encode())
            destination.flush()
        source.close()

    thread = threading.Thread(target=copy, name="mpiallreduce-launch-output", daemon=True)
    thread.start()
    return thread
