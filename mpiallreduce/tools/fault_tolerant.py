"""What ``mpiallreduce launch --fault-tolerant`` adds to mpiexec for ULFM
(mpiallreduce.faults.ulfm).

--with-ft ulfm                 a rank's death becomes an error the survivors can handle, not the
                               job's end
--mca btl_tcp_flags ...        no "put" in the TCP BTL: Open MPI 5.0.x's btl/tcp deadlocks a
                               survivor that finds the dead peer while sending it a large message
                               (mca_btl_tcp_frag_send -> endpoint_close -> ob1's error path ->
                               mca_pml_ob1_send_fin -> mca_btl_tcp_endpoint_send, which locks the
                               endpoint's mutex it holds already; gdb, 3 runs of 10 across 2
                               emulated nodes, issue #29). Without put, large messages go by
                               send/receive, which sends no FIN: 20 runs of 20 went on
--mca coll <...,^han>          without coll/han: a peer dying inside its MPI_Allreduce can leave a
                               survivor MPI_SUCCESS and a result never written (2 runs of 3; with
                               tuned 0 of 8: tests/faults/inject.py peers_die_mid_call). The
                               user's own OMPI_MCA_coll is kept, han taken out of it
                               (mpiallreduce.faults.coll_han.without_han)
"""

import os

from ..faults.coll_han import without_han

__all__ = ["FAULT_TOLERANT_FLAGS", "fault_tolerant_flags"]

_ULFM_FLAGS = ("--with-ft", "ulfm", "--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum")


def fault_tolerant_flags(environ=None):
    """mpiexec's flags for ULFM, the environment's OMPI_MCA_coll kept but for han."""
    env = os.environ if environ is None else environ
    return _ULFM_FLAGS + ("--mca", "coll", without_han(env.get("OMPI_MCA_coll", "")))


#: the flags where the environment selects no coll components of its own
FAULT_TOLERANT_FLAGS = fault_tolerant_flags({})
