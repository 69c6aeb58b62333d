"""How a rank that waits by spinning (on a shared slot, on a peer's message) gives its core to
another process: a rank waiting on a peer that shares the core would otherwise keep that peer from
running. Below the core's pipeline (slots) and the faults layer (watch, outcome, bounded), which
all spin so."""

import os

__all__ = ["yield_core"]

#: give the core to another process (a rank waiting on a peer that shares it)
yield_core = getattr(os, "sched_yield", lambda: None)
