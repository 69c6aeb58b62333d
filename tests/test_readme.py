"""The docs' examples run as written: every code block of README.md, docs/*.md and jobs/README.md.

Python. The first line of every ```python block says how it runs, in one of two forms:

    # 2 ranks: mpiallreduce launch -n 2 -- python first.py     a complete program, named first.py
    # 2 ranks, continues the block above                         the page's blocks before it, then
                                                                 this

(a complete program that needs ULFM says `--fault-tolerant` before the `--`, and is launched so). A
block in neither form fails test_every_python_block_says_how_it_runs, which names the page and the
line. A complete block and the continuations that follow it on its page make a chain: their texts
in order, run as one program in one launch, on the rank count of the chain's last block, so a page
costs one launch per chain, not per block. Nothing is prepended: every name a block uses is defined
in it or in the chain before it. A chain that imports cupy is skipped where CuPy has no usable
GPU; one that imports torch (or mpiallreduce.torch) where torch does not import.

Shell. Every ```sh block runs line by line in one folder, in order (so later lines read what earlier
ones wrote). The folder holds every page's complete programs under the names their first lines
give (`python first.py` runs README.md's first program). `bench` and `tune` are cut to two sizes
(64 B, 4 KiB) and two repetitions (`tune` to one run), and `bench` to `auto` and `ring` where it
names no algorithms and one of Open MPI's forced ones (tests/test_under_mpiexec.py runs every
contender); `--device gpu` and programs that import cupy run only where a GPU is usable, `--nodes`
(emulated nodes) only as root with unshare. Not run here: `make` (CI runs it), `pip` and making a
venv (they would install), `pytest` (these are the tests), the GPU check's scripts
(tests/test_device_check.py runs its dry run), and what needs a cluster (`srun`, `sbatch`, `module`,
and `launch` without -n, which is for inside an allocation), and a program's own launch line, as its
first line gives it (the Python test ran that program). Plain `mpiexec` runs as written, its extra
ranks allowed onto a small machine by PRRTE's oversubscribe policy in the environment (a cluster
node has the slots).
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpiallreduce.tools.launch import FAULT_TOLERANT_FLAGS, launch_environment, run

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "jobs" / "README.md"]
TIMEOUT = 120

COMPLETE = re.compile(
    r"# (\d+) ranks?: mpiallreduce launch -n \1 (--fault-tolerant )?-- python ([\w.-]+\.py)"
)
CONTINUES = re.compile(r"# (\d+) ranks?, continues the block above")
FORMS = (
    "'# 2 ranks: mpiallreduce launch -n 2 -- python example.py' or "
    "'# 2 ranks, continues the block above'"
)


def fenced_blocks(path, language, problems):
    """[(line number of the block's first line, its text)] of every ```language block of
    ``path``."""
    blocks, fence, lines = [], None, path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = (stripped[3:], number)
        elif fence is not None and stripped == "```":
            if fence[0] == language:
                blocks.append((fence[1] + 1, "\n".join(lines[fence[1] : number - 1]) + "\n"))
            fence = None
    if fence is not None:
        problems.append(f"{path.relative_to(ROOT)}:{fence[1]}: a ``` block that is never closed")
    return blocks


@dataclass
class Chain:
    """A complete program and the blocks that continue it: one launch."""

    page: str
    line: int
    name: str
    ranks: int
    flags: tuple
    first_block: str
    text: str

    @property
    def id(self):
        return f"{self.page}:{self.line}:{self.name}"


def python_chains():
    """Every page's chains, and what is wrong with the pages' ```python blocks."""
    chains, problems = [], []
    for path in PAGES:
        page, chain = str(path.relative_to(ROOT)), None
        for line, text in fenced_blocks(path, "python", problems):
            first = text.splitlines()[0] if text.strip() else ""
            complete, continues = COMPLETE.fullmatch(first), CONTINUES.fullmatch(first)
            if complete:
                chain = Chain(
                    page,
                    line,
                    complete[3],
                    int(complete[1]),
                    FAULT_TOLERANT_FLAGS if complete[2] else (),
                    text,
                    text,
                )
                chains.append(chain)
            elif continues and chain is not None:
                chain.ranks, chain.text = int(continues[1]), chain.text + text
            elif continues:
                problems.append(
                    f"{page}:{line}: {first!r} continues no complete block above it on its page"
                )
            else:
                problems.append(f"{page}:{line}: the first line {first!r} says neither {FORMS}")
    names = [chain.name for chain in chains]
    problems += [
        f"{chain.id}: the program name {chain.name} is taken by another page's program too"
        for chain in chains
        if names.count(chain.name) > 1
    ]
    return chains, problems


CHAINS, PROBLEMS = python_chains()


def needs(text):
    """The optional modules a program needs: 'cupy', 'torch', 'jax'."""
    return [
        module
        for module, pattern in (
            ("cupy", r"^\s*(import|from) cupy\b"),
            ("torch", r"^\s*(import|from) (torch|mpiallreduce\.torch)\b"),
            ("jax", r"^\s*(import|from) (jax|mpiallreduce\.jax)\b"),
        )
        if re.search(pattern, text, re.M)
    ]


def no_gpu():
    """Why CuPy cannot run here, or None where it can."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no GPU"
    except Exception as error:  # (not installed, no driver, no device)
        return f"no usable GPU: {type(error).__name__}: {error}"
    return None


def missing(modules):
    """Why a program that needs ``modules`` cannot run here, or None."""
    for module in modules:
        if module == "cupy" and no_gpu():
            return no_gpu()
        if module in ("torch", "jax"):
            try:
                __import__(module)
            except Exception as error:
                return f"{module} does not import: {type(error).__name__}: {error}"
    return None


def test_every_relative_link_in_the_pages_leads_to_a_file():
    """A page's links to other pages and files ([text](path), anchors aside) resolve from its
    folder."""
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in [*PAGES, *sorted((ROOT / "benchmarks").glob("*.md"))]
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if "://" not in target
        and not target.startswith("mailto:")
        and not (page.parent / target).exists()
    ]
    assert not broken, broken


def test_every_python_block_says_how_it_runs():
    assert CHAINS, "no ```python block found in the pages"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize("chain", CHAINS, ids=[chain.id for chain in CHAINS])
def test_python_example_runs_as_written(chain, tmp_path):
    reason = missing(needs(chain.text))
    if reason:
        pytest.skip(reason)
    script = tmp_path / chain.name
    script.write_text(chain.text)
    result = run(
        chain.ranks,
        [sys.executable, str(script)],
        timeout=TIMEOUT,
        extra_flags=chain.flags,
        cwd=tmp_path,
        env=dict(os.environ, MPIALLREDUCE_ABORT_ON_EXCEPTION="1"),
    )
    assert result.returncode == 0, (
        f"{chain.id} on {chain.ranks} ranks\n{chain.text}\n---\n{result.output[-4000:]}"
    )


NOT_RUN_HERE = re.compile(
    r"(^|\s)(make|pytest|module)(\s|$)|-m pip\b|\bpip install\b|-m venv\b"
    r"|\b(srun|sbatch|salloc)\b|benchmarks/gpu/|^OUT="
)


def shell_blocks():
    """(id, lines) of every ```sh block: continuation lines joined, comments dropped."""
    problems = []
    for path in PAGES:
        for line, block in fenced_blocks(path, "sh", problems):
            lines = [
                text.split("  #")[0].strip() for text in block.replace("\\\n", " ").splitlines()
            ]
            yield f"{path.relative_to(ROOT)}:{line}", [text for text in lines if text]


def cut_down(line):
    """The command to run here (bench and tune made short), or None if it is not for this
    machine."""
    if NOT_RUN_HERE.search(line) or re.search(r"mpiallreduce launch(?! -n )", line):
        return None
    if any(chain.first_block.splitlines()[0].split(": ", 1)[1] == line for chain in CHAINS):
        return None  # (a program's own launch line: test_python_example_runs_as_written ran it)
    if "--device gpu" in line and no_gpu():
        return (
            None  # (tests/test_device_check.py runs bench on the CuPy stand-in, --device fake-gpu)
        )
    if " --nodes " in line and (shutil.which("unshare") is None or os.geteuid() != 0):
        return (
            None  # (emulated nodes need root: tests/test_emulated_nodes.py says so where it skips)
        )
    for program in re.findall(r"python ([\w.-]+\.py)\b", line):
        chain = next((chain for chain in CHAINS if chain.name == program), None)
        if chain is not None and missing(needs(chain.first_block)):
            return None
    if re.search(r"mpiallreduce (bench|tune)\b", line):
        line = re.sub(r"--sizes \S+", "", line) + " --sizes 64,4K --repetitions 2"
        if "mpiallreduce bench" in line:  # (no more rounds where they have not settled)
            line += " --max-repetitions 2"
        if "mpiallreduce bench" in line and "--openmpi-forced" not in line:
            line += " --openmpi-forced 4"
        if (
            "mpiallreduce bench" in line and "--algorithms" not in line
        ):  # (every algorithm: test_under_mpiexec)
            line += " --algorithms auto,ring"
        if "mpiallreduce tune" in line and "--runs" not in line:
            line += " --runs 1"
    return line


SHELL_BLOCKS = list(shell_blocks())


@pytest.mark.parametrize(
    "lines", [lines for _, lines in SHELL_BLOCKS], ids=[name for name, _ in SHELL_BLOCKS]
)
def test_shell_example_runs_with_sizes_cut_down(lines, tmp_path):
    commands = [command for command in map(cut_down, lines) if command]
    if not commands:
        pytest.skip("nothing here runs on this machine: " + "; ".join(lines))
    for chain in CHAINS:
        (tmp_path / chain.name).write_text(chain.first_block)
    env = launch_environment(
        dict(
            os.environ,
            PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
            PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        )
    )
    for command in commands:
        done = subprocess.run(
            command,
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, f"{command}\n---\n{(done.stdout + done.stderr)[-4000:]}"


def test_the_results_page_is_what_its_command_writes():
    """docs/results.md is generated, never pasted: its first lines name the command, and running
    that command on the results folders in the repository now writes the same page."""
    import subprocess

    page = (ROOT / "docs" / "results.md").read_text()
    command = re.search(r"Written by `mpiallreduce report --markdown (\S+) ([^`]+)`", page)
    assert command, "docs/results.md does not say which command wrote it"
    folders = command.group(2).split()
    # (written beside the page, under a name of its own: the figures it links are relative to it)
    written = ROOT / "docs" / f".results-check-{os.getpid()}.md"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mpiallreduce", "report", "--markdown", str(written), *folders],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        text = written.read_text() if written.exists() else ""
    finally:
        written.unlink(missing_ok=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert text.replace(str(written), command.group(1)) == page, (
        "docs/results.md differs from what its command writes: run `mpiallreduce report --markdown "
        f"docs/results.md {' '.join(folders)}`"
    )


WHAT_AUTO_RUNS = """
import numpy as np, mpiallreduce as mar
from mpi4py import MPI
x = np.ones(1 << 18, np.float32)
lines = [mar.describe_call(x), mar.describe_call(x, reproducible=True), mar.describe_call(np.ones(16, np.float32)),
         mar.describe_call(np.ones(1 << 18, np.float16)), mar.describe_call(x, reproducible=True, algorithm="ring"),
         repr(mar.prepare(x))]
if MPI.COMM_WORLD.Get_rank() == 0:
    print("\\n".join(lines))
"""  # noqa: E501 (a program run as written: its text stays byte for byte)


def test_what_auto_runs_in_the_architecture_pages_example_is_what_it_runs_now(tmp_path):
    """docs/architecture.md shows describe_call's lines on 2 ranks of this machine (the shipped
    tuning table's choices), and call.md one of them: they are what it prints now."""
    script = tmp_path / "what_auto_runs.py"
    script.write_text(WHAT_AUTO_RUNS)
    env = {key: value for key, value in os.environ.items() if key != "MPIALLREDUCE_TUNING"}
    result = run(
        2, [sys.executable, str(script)], timeout=TIMEOUT, env=launch_environment(env), cwd=ROOT
    )
    assert result.returncode == 0, result.output[-3000:]
    printed = [line for line in result.output.splitlines() if line.strip()]
    assert len(printed) == 6, result.output[-3000:]
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    stale = [line for line in printed if line not in architecture]
    assert not stale, f"docs/architecture.md does not show what auto runs now: {stale}"
    call_page = " ".join((ROOT / "docs" / "call.md").read_text().replace("`", "").split())
    assert printed[0] in call_page, f"docs/call.md does not show what auto runs now: {printed[0]}"
