"""Where ``auto`` departs from the tuning table, by measurement: each bound here is a decision the
planner (mpiallreduce.core.planner) reads, with the runs that set it.

- plain calls whose signature goes in messages (across nodes, under ULFM): ``dissemination``, whose
  rounds carry the comparison, up to a size (``dissemination_pays``);
- a mean across nodes, from MEAN_ACROSS_NODES_FROM, where the table's choice sums and then divides
  in a pass of its own (MPI's own): MEAN_ACROSS_NODES, which divides each slice as it reduces it
  (``mean_across_nodes``). The table is measured on sums;
- symmetric buffers on one node: ``single_copy`` from SINGLE_COPY_FROM;
- a reproducible sum's direct route on one node: shared_memory below
  REPRODUCIBLE_SHARED_MEMORY_BELOW.
"""

__all__ = [
    "DISSEMINATION_UP_TO",
    "DISSEMINATION_TWO_RANKS_UP_TO",
    "DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO",
    "dissemination_pays",
    "MEAN_ACROSS_NODES",
    "MEAN_ACROSS_NODES_FROM",
    "mean_across_nodes",
    "SINGLE_COPY_FROM",
    "REPRODUCIBLE_SHARED_MEMORY_BELOW",
]

#: where a plain call compares its signature in messages (across nodes, under ULFM), every rank runs
#: the compiled paths and the table says MPI's own, ``auto`` runs dissemination up to this size (and
#: where its longest message is no longer: ``dissemination_pays``), whose rounds carry the
#: comparison: on 2 ranks one message each way, where the check and then MPI_Allreduce take a round
#: trip each. 2 emulated nodes, 2026-12-03 (benchmarks/results-signature/two-nodes.txt,
#: benchmarks/signature_exchange.py): 21.6-21.8 us against 43.6-44.6 at 4 B, 25.9-28.3 against
#: 48.9-49.5 at 8 KiB; up to 16 KiB where its messages fit (12 KiB and 16000 B won too in a /tmp
#: script, not kept: 31.6 against 56.0, 66.9 against 85.5)
DISSEMINATION_UP_TO = 16 << 10
#: on 2 ranks dissemination is one exchange of the whole buffer each way (recursive doubling's), its
#: blocks past one head in the message's tail, sent from the input where it lies, no copy of it made
#: (the compiled short path): ``auto`` runs it up to this size whatever the table says
#: (the check rides in the head), where the table's choice pays the check's exchange on top.
#: 2 emulated nodes, 2026-12-04 14:21-14:37, MPI_Allreduce's time over each in four interleaved runs
#: of plain calls out of place (benchmarks/results-signature/plain-two-nodes.txt): dissemination
#: 0.97-1.25x at 128 KiB, 1.03-1.09x at 256 KiB, 0.98-1.05x at 512 KiB, 0.97-1.03x at 768 KiB,
#: 0.90-1.03x at 1 MiB; the check and then MPI's own 0.86-1.01x, 0.91-0.94x, 0.93-0.99x, 0.91-0.98x,
#: 0.96-1.08x. In place (15:27-15:29, three /tmp runs) 0.97-1.00x at 512 KiB and 0.92-0.97x at
#: 768 KiB, against 0.96-0.99x and 0.99-1.01x. 512 KiB out of place: a margin below 768 KiB, not a
#: crossing
DISSEMINATION_TWO_RANKS_UP_TO = 512 << 10
#: in place (``out=x``: MPI's own copies nothing, dissemination's rank 1 copies its result), in two
#: runs (15:27, 15:30: benchmarks/results-signature/plain-two-nodes-in-place.txt), 1.06x and 0.97x
#: at 256 KiB against 0.93x and 0.93x, 1.00x and 0.91x at 512 KiB against 0.99x and 0.99x
DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO = 256 << 10


def dissemination_pays(size, nbytes, largest_message, in_place=False):
    """Whether ``auto`` runs dissemination for a plain call of ``nbytes`` on ``size`` ranks whose
    signature goes in messages (the planner asks where the rest allows): on 2 ranks up to
    DISSEMINATION_TWO_RANKS_UP_TO (DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO ``in_place``); on more,
    where the table says MPI's own, up to DISSEMINATION_UP_TO and where its longest message,
    ``largest_message`` (codes included), is no longer (Bruck's allgather sends (p - 1)n bytes per
    rank: for small buffers only; the bound measured when a head was 16 KiB, kept when heads
    grew)."""
    if size == 2:
        return nbytes <= (
            DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO if in_place else DISSEMINATION_TWO_RANKS_UP_TO
        )
    return nbytes <= DISSEMINATION_UP_TO and largest_message <= DISSEMINATION_UP_TO


#: 2 emulated nodes x 1 rank, 2026-12-04 (``mpiallreduce bench --op mean --mode
#: in-place|out-of-place --algorithms mpi,ring_pipelined``, 9-11 repetitions, four runs;
#: docs/notes-benchmarks.md): out of place ring_pipelined 2.05-2.79 ms against MPI's own 2.11-3.10
#: at 4 MiB, 3.01-4.11 against 3.45-4.48 at 6 MiB, 5.96 against 6.81 at 8 MiB, 10.4 against 15.2 at
#: 16 MiB; in place within the noise at 4-6 MiB (1.82-1.91 against 1.81-1.82 at 4 MiB, 2.58-2.84
#: against 2.74-2.78 at 6), ahead from 8 MiB (3.58 against 4.05, 7.74 against 9.07 at 16 MiB). In a
#: training step, where the bucket (6.1 MiB, in place) was just copied in, the mean by
#: ring_pipelined took 0.3-0.6 ms less than MPI's own and its division (/tmp runs)
MEAN_ACROSS_NODES, MEAN_ACROSS_NODES_FROM = "ring_pipelined", 4 << 20


def mean_across_nodes(op_name, nbytes, table_choice_divides):
    """Whether a mean across nodes runs MEAN_ACROSS_NODES rather than the table's choice (which
    does not divide as it reduces unless ``table_choice_divides``)."""
    return op_name == "mean" and nbytes >= MEAN_ACROSS_NODES_FROM and not table_choice_divides


#: a reproducible sum's direct route on one node runs shared_memory below this size,
#: pairwise_exchange from it: `launch -n 2 (and 4) -- python benchmarks/reproducible_cost.py
#: --direct-sizes 4K,64K,1M,4M,16M` (2 runs, 2026-12-01): shared_memory 0.59-0.92x / 0.95-1.04x /
#: 1.07-1.40x pairwise_exchange's time to 1 / 4 / 16 MiB
REPRODUCIBLE_SHARED_MEMORY_BELOW = 4 << 20
#: ``auto`` runs single_copy on symmetric buffers from this size (below: the table's choice):
#: `mpiallreduce bench --sizes 4,64K,1M,16M`, 2 ranks, 2026-12-02: single_copy (prepared) 17.6 us at
#: 4 B against Open MPI's 4.6 (two barriers, and Python), 18.0 against 25.9 us at 64 KiB, 111
#: against 307 us at 1 MiB
SINGLE_COPY_FROM = 64 << 10
