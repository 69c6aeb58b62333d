"""Every MPIALLREDUCE_* setting, read from the environment in one place, once.

    SETTINGS = Settings.from_environment()      # at first use; tests may build their own

Settings that change what the ranks send one another (segment sizes, the tuning table, the default
timeout, whether MPI takes device pointers, the size from which calls are compared) must be the
same on every rank of a communicator: a rank with another segment size would cut the buffer
differently and wait for messages that never come. The library compares them once per
communicator, on its first use (``state.CommState``: one 16-byte allreduce of a digest; the whole
table is gathered only when the digests differ), and a difference raises on every rank, naming the
setting and the ranks.
"""

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

__all__ = [
    "Settings",
    "settings",
    "reset_settings",
    "parse_bool",
    "parse_bytes",
    "TRUE_WORDS",
    "FALSE_WORDS",
]

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


def parse_bool(name, text, default=False):
    text = (text or "").strip().lower()
    if not text:
        return default
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={text!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def parse_bytes(name, text, default):
    """A size in bytes: a plain number or with a K, M or G suffix (powers of 1024)."""
    text = (text or "").strip()
    if not text:
        return default
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ValueError(
            f"{name}={text!r}: expected a number of bytes (K, M, G suffixes allowed)"
        ) from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a number of bytes >= 0")
    return value


def _seconds(name, text):
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected seconds (a number >= 0)") from None
    if value < 0 or math.isnan(value):
        raise ValueError(f"{name}={text!r}: expected seconds >= 0")
    return value or None  # 0: wait for ever


def _fraction(name, text, default):
    text = (text or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ValueError(f"{name}={text!r}: expected a fraction in (0, 1]")
    return value


@dataclass(frozen=True)
class Settings:
    """What the environment says, once. Fields marked ``agreed`` must match across ranks."""

    #: MPIALLREDUCE_CHECK: every call compares its arguments, call number and site across ranks
    check: bool = False
    #: MPIALLREDUCE_TIMEOUT: seconds a call waits for every rank to arrive (None: for ever)
    timeout: float | None = None
    #: MPIALLREDUCE_TIMEOUT_WARN_FRACTION: a stall warning after this fraction of the timeout
    warn_fraction: float = 0.5
    #: MPIALLREDUCE_SIGNATURE_MIN_BYTES: calls of at least this many bytes compare shape, dtype,
    #: op and algorithm across ranks before moving data (mpiallreduce.core.consistency); 0, the
    #: default, every call; "off" never (-1): a mismatch may then give wrong values
    signature_min_bytes: int = 0
    #: MPIALLREDUCE_RING_SEGMENT_BYTES: the segment of ring_pipelined and of pairwise_exchange's
    #: reduce-scatter
    ring_segment_bytes: int = 1 << 20
    #: MPIALLREDUCE_STAGED_SEGMENT_BYTES: staged_ring's segment (not yet tuned on a GPU)
    staged_segment_bytes: int = 4 << 20
    #: MPIALLREDUCE_TUNING: the tuning table's path ("" for the one shipped; the ranks must agree on
    #: the table's content, not its path)
    tuning_path: str = ""
    #: MPIALLREDUCE_CUDA_AWARE: True/False forces; None asks the MPI library
    cuda_aware: bool | None = None
    #: MPIALLREDUCE_RANKS_PER_NODE: pretend every k consecutive ranks form a node (0: real nodes)
    ranks_per_node: int = 0
    #: MPIALLREDUCE_ABORT_ON_EXCEPTION
    abort_on_exception: bool = False
    #: MPIALLREDUCE_DEBUG_INPUTS: allreduce_async checksums its input at the start and once reduced
    #: (the ranks then agree on the outcome: a collective, so the ranks must agree on this setting)
    debug_inputs: bool = False
    #: MPIALLREDUCE_TRACE_ENTRIES: how many of its last calls each rank's flight recorder keeps
    #: (mpiallreduce.faults.recorder); 0, the default: no recorder (it costs 0.2-0.35 us a call, and
    #: sends calls to the Python paths, not the compiled ones: 0.8 to 1.2 us at 4 B)
    trace_entries: int = 0
    #: MPIALLREDUCE_TRACE_DIR: where the recorder's dumps go ("": ./mpiallreduce-trace)
    trace_dir: str = ""
    #: MPIALLREDUCE_COMPILED: repeated calls take the compiled hot paths where they were built
    #: (mpiallreduce.core.compiled); 0: the Python ones only. Not agreed: both do the same
    compiled: bool = True

    #: the fields every rank of a communicator must agree on
    AGREED = (
        "check",
        "timeout",
        "signature_min_bytes",
        "ring_segment_bytes",
        "staged_segment_bytes",
        "cuda_aware",
        "ranks_per_node",
        "debug_inputs",
    )

    @classmethod
    def from_environment(cls, environ=None):
        env = os.environ if environ is None else environ
        signature = (env.get("MPIALLREDUCE_SIGNATURE_MIN_BYTES") or "").strip()
        cuda_aware_text = (env.get("MPIALLREDUCE_CUDA_AWARE") or "").strip()
        ranks_per_node = (env.get("MPIALLREDUCE_RANKS_PER_NODE") or "").strip()
        if ranks_per_node and (not ranks_per_node.isdigit() or int(ranks_per_node) < 1):
            raise ValueError(
                f"MPIALLREDUCE_RANKS_PER_NODE={ranks_per_node!r}: expected a whole number >= 1"
            )
        return cls(
            check=parse_bool("MPIALLREDUCE_CHECK", env.get("MPIALLREDUCE_CHECK")),
            timeout=_seconds("MPIALLREDUCE_TIMEOUT", env.get("MPIALLREDUCE_TIMEOUT")),
            warn_fraction=_fraction(
                "MPIALLREDUCE_TIMEOUT_WARN_FRACTION",
                env.get("MPIALLREDUCE_TIMEOUT_WARN_FRACTION"),
                0.5,
            ),
            signature_min_bytes=(
                -1
                if signature.lower() in FALSE_WORDS - {"0"}
                else parse_bytes("MPIALLREDUCE_SIGNATURE_MIN_BYTES", signature, 0)
            ),
            ring_segment_bytes=_positive(
                parse_bytes(
                    "MPIALLREDUCE_RING_SEGMENT_BYTES",
                    env.get("MPIALLREDUCE_RING_SEGMENT_BYTES"),
                    1 << 20,
                ),
                "MPIALLREDUCE_RING_SEGMENT_BYTES",
            ),
            staged_segment_bytes=_positive(
                parse_bytes(
                    "MPIALLREDUCE_STAGED_SEGMENT_BYTES",
                    env.get("MPIALLREDUCE_STAGED_SEGMENT_BYTES"),
                    4 << 20,
                ),
                "MPIALLREDUCE_STAGED_SEGMENT_BYTES",
            ),
            tuning_path=(env.get("MPIALLREDUCE_TUNING") or "").strip(),
            cuda_aware=(
                None
                if not cuda_aware_text
                else parse_bool("MPIALLREDUCE_CUDA_AWARE", cuda_aware_text)
            ),
            ranks_per_node=int(ranks_per_node or 0),
            abort_on_exception=parse_bool(
                "MPIALLREDUCE_ABORT_ON_EXCEPTION", env.get("MPIALLREDUCE_ABORT_ON_EXCEPTION")
            ),
            debug_inputs=parse_bool(
                "MPIALLREDUCE_DEBUG_INPUTS", env.get("MPIALLREDUCE_DEBUG_INPUTS")
            ),
            trace_entries=_count(
                "MPIALLREDUCE_TRACE_ENTRIES", env.get("MPIALLREDUCE_TRACE_ENTRIES"), 0
            ),
            trace_dir=(env.get("MPIALLREDUCE_TRACE_DIR") or "").strip(),
            compiled=parse_bool(
                "MPIALLREDUCE_COMPILED", env.get("MPIALLREDUCE_COMPILED"), default=True
            ),
        )

    def agreed(self, **more):
        """{name: value} of every setting that must be the same on every rank (and ``more``: the
        tuning table's digest, which mpiallreduce.state adds)."""
        return dict({name: getattr(self, name) for name in self.AGREED}, **more)

    def describe(self):
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    def as_dict(self):
        return asdict(self)


def _count(name, text, default):
    text = (text or "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}: expected a whole number >= 0")
    return int(text)


def _positive(value, name):
    if value < 1:
        raise ValueError(f"{name}={value}: expected a segment of at least 1 byte")
    return value


_settings = None


def settings():
    """The settings of this process (read from the environment the first time)."""
    global _settings
    if _settings is None:
        _settings = Settings.from_environment()
    return _settings


def reset_settings(value=None):
    """Use ``value`` (a Settings), or read the environment again at the next use (tests). Repeated
    calls then leave the short path once, so that their communicator agrees on the new settings."""
    global _settings
    _settings = value
    for forget in ON_RESET:
        forget()


#: what reset_settings calls (mpiallreduce.core.state: forget every short path)
ON_RESET: list[Callable[[], None]] = []
