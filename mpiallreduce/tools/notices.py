"""Open MPI's notices in a launch's output that tell the user nothing the ranks have not told.

    ranks ──stdout── mpiexec ──pipe──────────────────── the launcher's stdout (as it comes)
          ──stderr──         ──pipe── NoticeFilter ──── the launcher's stderr

What is left out, and only that:
- PRRTE's ``plm:ssh: Warning: setpgid(P,P) failed in parent with errno=Permission denied(13)``:
  printed unconditionally (plm_ssh_module.c) when the parent's setpgid of a daemon's launch agent
  loses the race with the child's own setpgid and exec (EACCES), which every ``--nodes`` launch may
  do; the child is in its process group either way;
- the ``MPI_ABORT was invoked on rank R ...`` notice and prterun's "has exited due to process rank
  R ... calling abort" or "exited with non-zero status" (process R), once rank R has said why the
  job ends (``[rank R] mpiallreduce: ... aborting the MPI job``: its traceback, or its
  ``sys.exit(n)``; see mpiallreduce.faults.aborting); a notice that names no rank, once any rank
  has, and every such notice once a rank printed a usage error of the package's commands (every
  rank leaves for it alike). Otherwise they stay: then they are the only explanation. The rank's
  line and Open MPI's notice reach mpiexec by different routes (the rank's stderr, and the notice
  through PRRTE), in either order: such a notice is held until its rank says why (then dropped), for
  HOLD_SECONDS at most, or until the output ends (then it goes out).

A notice is the block between two lines of 74 dashes (Open MPI's show_help), on stderr, where Open
MPI and PRRTE write all of these; stdout is not filtered. ``mpiallreduce launch --mpi-notices``
shows everything.
"""

import os
import re
import select
import threading
import time

__all__ = ["NoticeFilter", "filter_text", "pump"]

RULE = "-" * 74
#: a notice longer than this is not one of Open MPI's: pass it on as it came
MAX_NOTICE_LINES = 40
HARMLESS_LINES = (
    re.compile(
        r"^\[[^\]]*\] plm:ssh: Warning: setpgid\(\d+,\d+\) failed in parent with errno=Permission "
        r"denied\(13\)$"
    ),
)
#: what rank R prints before it aborts the job (faults/aborting.py): the job's end is explained
RANKS_SAID_WHY = re.compile(r"mpiallreduce: .*?\brank (\d+)\b.*aborting the MPI job")
#: said_why's entry for a line that explains every rank's notice
EVERY_RANK = -1
#: a usage error of the package's commands (tools/arguments.py): every rank leaves for it alike,
#: so it explains every rank's notice
USAGE_ERROR = re.compile(r"^mpiallreduce[\w -]*: error: ")
#: the notices about a job's end that a rank's line explains: (a phrase that marks one, the
#: pattern of the rank it names: its rank in MPI_COMM_WORLD)
EXPLAINED_NOTICES = (
    (
        "MPI_ABORT was invoked on rank",
        re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator MPI_COMM_WORLD\b"),
    ),
    ("has exited due to process rank", re.compile(r"has exited due to process rank (\d+)\b")),
    ("exited with non-zero status", re.compile(r"Process name: \[[^\]]*,(\d+)\]")),
)
#: how long such a notice waits for its rank's line: the two come within milliseconds of each
#: other, but the output may stay open long after the job's end (a rank's orphaned child)
HOLD_SECONDS = 2.0


class NoticeFilter:
    """Filters one stream line by line (stderr; ``said_why``, the set of ranks that said why the
    job ends, may be shared)."""

    def __init__(self, said_why=None, show_all=False):
        self.said_why = set() if said_why is None else said_why
        self.show_all = show_all
        self.block = None  # the lines of a notice being read
        # (since when, the rank it names or None, its lines): notices a line may explain
        self.held = []

    def feed(self, line):
        """The lines to write now, given one line (with its newline, if it has one)."""
        if self.show_all:
            return [line]
        text = line.rstrip("\r\n")
        self.heard(text)
        if self.block is not None:
            self.block.append(line)
            if text == RULE:
                return self._close()
            if len(self.block) > MAX_NOTICE_LINES:
                return self.flush(end=False)
            return []
        if text == RULE:
            self.block = [line]
            return []
        if any(pattern.match(text) for pattern in HARMLESS_LINES):
            return []
        return [line]

    def heard(self, text):
        """Note a line (or the start of one, written out before its end) that may say why the job
        ends: the notices it explains are then dropped."""
        said = RANKS_SAID_WHY.search(text)
        if said or USAGE_ERROR.match(text):
            self.said_why.add(int(said.group(1)) if said else EVERY_RANK)
            self.held = [notice for notice in self.held if not self._explained(notice[1])]

    def _close(self):
        block, self.block = self.block, None
        body = "".join(block)
        for phrase, names in EXPLAINED_NOTICES:
            if phrase in body:
                named = names.search(body)
                rank = int(named.group(1)) if named else None
                if not self._explained(rank):
                    self.held.append((time.monotonic(), rank, block))
                return []
        return block

    def _explained(self, rank):
        """Whether a notice naming ``rank`` (None: no rank) is explained by a rank's line."""
        if EVERY_RANK in self.said_why:
            return True
        return rank in self.said_why if rank is not None else bool(self.said_why)

    def due(self, now=None):
        """The held notices that waited HOLD_SECONDS for their rank's line in vain: their lines."""
        now = time.monotonic() if now is None else now
        lines = [
            line for since, _, block in self.held if now - since >= HOLD_SECONDS for line in block
        ]
        self.held = [notice for notice in self.held if now - notice[0] < HOLD_SECONDS]
        return lines

    def seconds_to_due(self):
        """How long until the first held notice is due (None: none is held)."""
        return max(0.0, self.held[0][0] + HOLD_SECONDS - time.monotonic()) if self.held else None

    def flush(self, end=True):
        """What is held back: an unfinished notice; at the ``end`` of the stream, also the notices
        that no rank explained."""
        block, self.block = self.block or [], None
        if end:
            block = [line for _, _, notice in self.held for line in notice] + block
            self.held = []
        return block


def filter_text(text, show_all=False):
    """``text`` (a launch's captured output) without the notices above."""
    notices = NoticeFilter(show_all=show_all)
    kept = [piece for line in text.splitlines(keepends=True) for piece in notices.feed(line)]
    return "".join(kept + notices.flush())


#: how long a notice being read (or the start of a line that may be one) is held back while no
#: more output comes: Open MPI writes a notice at once, so a pause means it is not one
QUIET_SECONDS = 0.3


def pump(source, destination, notices=None, on_broken=None):
    """A thread copying binary file ``source`` (a pipe) to binary file ``destination``, bytes as
    they are; through ``notices`` (a NoticeFilter) if given, line by line. A partial line that
    cannot start a notice or a known line goes out at once (a prompt is not held back), and what is
    held goes out after QUIET_SECONDS without more output. If ``destination`` is closed
    (``| head``), ``on_broken()`` is called once and the rest is read and dropped."""

    def copy():
        fd, pending, midline, broken = source.fileno(), b"", False, [False]

        def write(pieces):
            data = b"".join(
                p if isinstance(p, bytes) else p.encode("utf-8", "surrogateescape") for p in pieces
            )
            if not data or broken[0]:
                return
            try:
                destination.write(data)
                destination.flush()
            except (BrokenPipeError, ValueError):
                broken[0] = True
                if on_broken is not None:
                    on_broken()

        while True:
            if notices is not None and (notices.block is not None or pending or notices.held):
                reading = notices.block is not None or pending
                quiet = QUIET_SECONDS if reading else notices.seconds_to_due()
                if not select.select([fd], [], [], quiet)[
                    0
                ]:  # (quiet: not a notice in the writing)
                    notices.heard(pending.decode("utf-8", "surrogateescape"))
                    write(notices.due() + notices.flush(end=False) + [pending])
                    pending, midline = b"", midline or bool(pending)
                    continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if notices is None:
                write([chunk])
                continue
            # (PRRTE ends a notice with its C string's NUL, which then heads the next line: not
            # text)
            *lines, pending = (line.lstrip(b"\0") for line in (pending + chunk).split(b"\n"))
            out = notices.due()
            for line in lines:
                line += b"\n"
                out += [line] if midline else notices.feed(line.decode("utf-8", "surrogateescape"))
                midline = False
            if pending and notices.block is None and not pending.startswith((b"-", b"[")):
                notices.heard(pending.decode("utf-8", "surrogateescape"))
                out.append(pending)
                pending, midline = b"", True
            write(out)
        write((notices.flush() if notices is not None else []) + [pending])
        source.close()

    thread = threading.Thread(target=copy, name="mpiallreduce-launch-output", daemon=True)
    thread.start()
    return thread
