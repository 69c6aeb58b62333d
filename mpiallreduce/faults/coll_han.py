"""Open MPI's coll/han in an OMPI_MCA_coll selection (no MPI here: the launcher reads it too).

Under ULFM, when a peer dies inside han's MPI_Allreduce, a survivor's call can return MPI_SUCCESS
with its result never written (docs/faults.md): ``mpiallreduce launch --fault-tolerant`` takes han
out (``without_han``), and the library warns where it is still selectable (``han_selectable``).
"""

__all__ = ["without_han", "han_selectable"]


def _coll_selection(selection):
    """(whether it excludes, the component names) of an OMPI_MCA_coll value ("": exclude none)."""
    text = selection.replace(" ", "")
    return text.startswith("^") or not text, [name for name in text.lstrip("^").split(",") if name]


def without_han(selection):
    """An OMPI_MCA_coll value that selects what ``selection`` does, but never coll/han: an
    exclusion list grows by han, an inclusion list loses it."""
    excluding, names = _coll_selection(selection)
    kept = [name for name in names if name != "han"]
    return ",".join(kept) if kept and not excluding else "^" + ",".join(kept + ["han"])


def han_selectable(environ):
    """Whether Open MPI may select coll/han under ``environ``: not excluded or left out by
    OMPI_MCA_coll, nor switched off by its priority 0."""
    excluding, names = _coll_selection(environ.get("OMPI_MCA_coll", ""))
    off = environ.get("OMPI_MCA_coll_han_priority", "").strip() in ("0", "-1")
    return not off and ("han" in names) != excluding
