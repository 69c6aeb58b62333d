"""Command-line arguments of the ``mpiallreduce`` commands.

Every rank of a launch parses the same argv, so a mistake is the same mistake everywhere: rank 0
says it once, in one line, and every rank exits with status 2 without
communicating (no traceback per rank, no collective that a rank might not reach). Values are
checked before anything runs: a size that is not a size, an algorithm that does not exist, an op
the dtype cannot take.
"""

import argparse
import difflib
import os
import sys

__all__ = ["ArgumentParser", "parse_size", "size_list", "unknown", "launch_rank"]

#: where launchers put a rank's number before MPI is initialised (Open MPI, PMIx, MPICH, Slurm)
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def launch_rank():
    """This process's rank as its launcher gave it (0 outside a launch)."""
    for variable in _RANK_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for the package's commands: errors in one line, which rank 0 alone prints
    (every rank exits 2, alike: no rank's notice that it ends the job), with a "did you mean" for
    a mistyped option; ``examples`` (command lines) after the options in ``--help``; no rST
    backticks in what ``--help`` shows."""

    def __init__(self, *args, examples=(), **kwargs):
        if examples:
            kwargs["epilog"] = "examples:\n" + "\n".join(f"  {line}" for line in examples)
            kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        if kwargs.get("description"):
            kwargs["description"] = kwargs["description"].replace("``", "")
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if isinstance(kwargs.get("help"), str):
            kwargs["help"] = kwargs["help"].replace("``", "")
        return super().add_argument(*args, **kwargs)

    def error(self, message):
        says = launch_rank() == 0
        if says:
            print(
                f"{self.prog}: error: {self._with_guess(message)} (--help: usage)",
                file=sys.stderr,
                flush=True,
            )
        from ..faults.aborting import exit_alike

        exit_alike(2, said=says)

    def _with_guess(self, message):
        """``message`` with "did you mean" for an unrecognized option close to a known one."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return message
        known = [o for action in self._actions for o in action.option_strings]
        guesses = []
        for word in message[len(prefix) :].split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1)
            if word.startswith("-") and close:
                guesses.append(f"{word}: did you mean {close[0]}?")
        return message + ("; " + "; ".join(guesses) if guesses else "")


def parse_size(text):
    """'64' -> 64, '4K' -> 4096, '16M' -> 16 MiB, '1G' -> 1 GiB (bytes); ValueError saying what is
    wrong otherwise."""
    cleaned = text.strip().upper()
    for suffix in ("IB", "B"):
        if (
            cleaned.endswith(suffix)
            and cleaned[: -len(suffix)][-1:] in "KMG0123456789"
            and len(cleaned) > len(suffix)
        ):
            cleaned = cleaned[: -len(suffix)]
            break
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(cleaned[-1:], 1)
    number = cleaned[:-1] if scale != 1 else cleaned
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"{text.strip()!r} is not a size: give bytes as a number with an optional K, M or G "
            "(64, 4K, 16M)"
        ) from None
    if value < 0 or value * scale != int(value * scale):
        raise ValueError(f"{text.strip()!r} is not a whole, non-negative number of bytes")
    return int(value * scale)


def size_list(text):
    """An argparse type: '4,4K,1M' -> [4, 4096, 1048576]."""
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def unknown(what, name, known):
    """'unknown algorithm 'rign' (did you mean 'ring'?); known: ...'."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {name!r}{hint}; known: {', '.join(known)}"
