"""Helpers for testing mpiallreduce without special hardware (see :mod:`.fake_cupy`)."""
