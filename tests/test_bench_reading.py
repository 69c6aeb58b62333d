"""How a bench run is read, in one process (the MPI runs are tests/test_under_mpiexec.py's): when a
gain is noise, when repetitions have settled, which sizes a sweep holds, where a run is written,
and the figures (lines broken where the sweep has an unmeasured size). Expected values are worked
out by hand beside each case."""

import os
from types import SimpleNamespace

import pytest

from mpiallreduce.tools.bench.driver import (
    FULL_SIZES,
    QUICK_SIZES,
    new_run_folder,
    point_latest,
    sizes_argument,
)
from mpiallreduce.tools.bench.report import format_gain_table, gain_rows, within_noise
from mpiallreduce.tools.bench.timing import settled
from mpiallreduce.tools.plot import plot_results
from mpiallreduce.tools.plot_axes import segments


def measurement(algorithm, nbytes, median, q1=None, q3=None, low=None, high=None, in_place=False):
    return SimpleNamespace(
        ranks=2,
        nbytes=nbytes,
        count=nbytes // 4,
        dtype="float32",
        op="sum",
        algorithm=algorithm,
        in_place=in_place,
        iterations=10,
        repetitions=5,
        time_us=median,
        algbw_gbs=nbytes / median / 1e3,
        busbw_gbs=nbytes / median / 1e3,
        wrong=0,
        time_us_low=low,
        time_us_high=high,
        bound_us=median / 4,
        time_us_q1=q1,
        time_us_q3=q3,
    )


def test_a_gain_is_noise_where_the_middle_halves_overlap():
    baseline = measurement("openmpi", 64, 10.0, q1=9.0, q3=11.0, low=5.0, high=40.0)
    # 10.5..12 overlaps 9..11; 11.5..13 does not, though the whole ranges (5..40) would
    assert within_noise(baseline, measurement("ring", 64, 11, q1=10.5, q3=12.0)) is True
    clear = measurement("ring", 64, 12, q1=11.5, q3=13.0, low=8, high=14)
    assert within_noise(baseline, clear) is False
    # results from before the quartiles were kept: the fastest and slowest repetition
    old = measurement("openmpi", 64, 10.0, low=9.0, high=11.0)
    assert within_noise(old, measurement("ring", 64, 10.0, low=10.5, high=12.0)) is True
    assert within_noise(old, measurement("ring", 64, 6.0, low=5.0, high=8.0)) is False
    assert within_noise(measurement("openmpi", 64, 10.0), old) is None


def test_the_gain_table_says_same_where_the_gain_is_noise_and_a_number_elsewhere():
    results = [
        measurement("openmpi", 64, 10.0, q1=9.0, q3=11.0),
        measurement("ring", 64, 5.0, q1=4.8, q3=5.2),  # 2.00x, clear of the noise
        measurement("auto", 64, 10.5, q1=10.0, q3=11.5),  # 0.95x, within it
    ]
    rows = gain_rows(results)
    assert rows[0]["gain"] == pytest.approx(2.0) and rows[0]["auto_gain"] == pytest.approx(
        10 / 10.5
    )
    table = format_gain_table(rows)
    line = table.splitlines()[-1].split()
    assert line[:6] == ["2", "64", "10.0", "5.0", "ring", "2.00x"], table
    assert line[6] == "same" and "0.95" not in table, table
    assert '"same": the same within the noise' in table


def test_repetitions_settle_when_their_middle_half_is_within_a_tenth_of_the_median():
    assert settled([1.0, 1.0, 1.0, 1.0, 1.0])
    assert settled([1.0, 1.02, 0.98, 1.01, 5.0])  # one stall moves neither quartile much
    assert not settled([1.0, 2.0, 1.0, 2.0, 1.5])  # quartiles 1 and 2, median 1.5
    assert not settled([1.0])


def test_the_sweeps():
    assert sizes_argument("quick") == list(QUICK_SIZES)
    assert len(QUICK_SIZES) == 11 and QUICK_SIZES[0] == 4 and QUICK_SIZES[-1] == 64 << 20
    assert 4096 in QUICK_SIZES and 1 << 20 in QUICK_SIZES
    assert sizes_argument("full") == [4 << k for k in range(27)]
    assert FULL_SIZES[-1] == 256 << 20
    assert sizes_argument("4,4K") == [4, 4096]


def test_each_run_gets_a_folder_of_its_own_and_latest_points_at_the_newest(tmp_path):
    first = new_run_folder(tmp_path, 2)
    second = new_run_folder(tmp_path, 2)  # (the same second, most likely: a suffix)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert os.path.basename(first).startswith("bench-2ranks-")
    point_latest(tmp_path, first)
    point_latest(tmp_path, second)
    assert os.path.realpath(tmp_path / "latest") == os.path.realpath(second)
    assert not os.path.isabs(os.readlink(tmp_path / "latest"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == sorted(
        [os.path.basename(first), os.path.basename(second)]
    )


def test_a_line_breaks_where_the_sweep_has_a_size_it_did_not_measure():
    sweep = [4, 64, 1024, 4096, 16384]
    points = [(4, 1.0), (64, 2.0), (4096, 3.0), (16384, 4.0)]
    assert segments(points, sweep) == [[(4, 1.0), (64, 2.0)], [(4096, 3.0), (16384, 4.0)]]
    assert segments([(1024, 1.0)], sweep) == [[(1024, 1.0)]]


def test_plot_writes_the_headline_first_and_the_per_algorithm_figures(tmp_path):
    sizes = [4, 64, 1024]
    measurements = []
    for in_place in (False, True):
        for i, nbytes in enumerate(sizes):
            for algorithm, scale in (
                ("openmpi", 1.0),
                ("openmpi:ring", 1.1),
                ("auto", 0.5),
                ("ring", 0.7),
                ("mpi", 1.0),
            ):
                if algorithm == "ring" and nbytes == 64:
                    continue  # ring failed there: its line breaks
                median = (i + 1) * 10.0 * scale
                measurements.append(
                    vars(
                        measurement(
                            algorithm, nbytes, median, median * 0.9, median * 1.1, in_place=in_place
                        )
                    )
                )
    results = {
        "metadata": {"ranks": 2, "mpi_library": "Open MPI v5", "hosts": ["here"]},
        "memcpy_gbs": 5.0,
        "measurements": measurements,
    }
    written = plot_results(results, tmp_path)
    assert [os.path.basename(p) for p in written] == [
        "headline.png",
        "busbw_out_of_place.png",
        "gain_out_of_place.png",
        "busbw_in_place.png",
        "gain_in_place.png",
    ]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_bench_csv_read_alone_gives_numbers_and_nones(tmp_path):
    from mpiallreduce.tools.bench.report import write_results
    from mpiallreduce.tools.bench.timing import Measurement
    from mpiallreduce.tools.results import load_results

    old = Measurement(**vars(measurement("openmpi", 64, 10.0, low=9.0, high=11.0)))  # (no q1, q3)
    new = Measurement(**vars(measurement("ring", 64, 10.2, q1=9.6, q3=10.4, low=9.5, high=12.0)))
    write_results(tmp_path, [old, new], {"ranks": 2}, 5.0)
    rows = load_results(str(tmp_path / "bench.csv"))["measurements"]
    assert rows[0]["time_us_q1"] is None and rows[0]["time_us_low"] == 9.0
    assert rows[1]["time_us_q1"] == 9.6 and rows[1]["bound_us"] == pytest.approx(10.2 / 4)
    # 9.6..10.4 overlaps 9.0..11.0 as numbers (as text, "10.4" < "9.0")
    assert within_noise(SimpleNamespace(**rows[0]), SimpleNamespace(**rows[1])) is True


def test_latest_is_not_pointed_where_a_folder_of_that_name_stands(tmp_path):
    (tmp_path / "latest").mkdir()
    run = new_run_folder(tmp_path, 2)
    with pytest.raises(FileExistsError, match="not a symbolic link"):
        point_latest(tmp_path, run)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["latest", os.path.basename(run)])


def test_a_run_of_open_mpi_alone_has_no_gain_rows():
    assert gain_rows([measurement("openmpi", 64, 10.0), measurement("openmpi:ring", 64, 9.0)]) == []


def test_only_the_unsettled_are_repeated_with_the_baseline_up_to_the_cap(monkeypatch):
    """timing._measure_size with scripted times in place of MPI (one rank, no communication): a
    steady contender stops at the least number of rounds; a noisy one goes on to the cap, Open
    MPI's default with it; where every one has settled, no round more."""
    import itertools

    import numpy as np

    from mpiallreduce.tools.bench import timing
    from mpiallreduce.tools.bench.contenders import BASELINE

    class OneRank:
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

        def Barrier(self):
            pass

        def allreduce(self, value, op=None):
            return value

    def measure(script, repetitions, most):
        streams = {name: iter(times) for name, times in script.items()}
        ran = []

        def timed(call, iterations, comm, prepare=None, memory=None):
            ran.clear()
            call()
            return next(streams[ran[0]]) if ran else 1e-6  # (the bound: no contender)

        def contender(name):
            return lambda send, out, comm: ran.append(name)

        monkeypatch.setattr(timing, "_time_calls", timed)
        monkeypatch.setattr(timing, "_warm_up", lambda *args: (1e-5, 0, None))
        monkeypatch.setattr(timing, "bound_pass", lambda *args: lambda: None)
        monkeypatch.setattr(timing, "_probe_seconds", lambda *args: 1e-5)
        found = timing._measure_size(
            OneRank(),
            {name: contender(name) for name in script},
            64,
            np.dtype("float32"),
            "sum",
            repetitions,
            False,
            max_repetitions=most,
        )
        return {m.algorithm: m.repetitions for m in found}

    steady = itertools.repeat(1e-5)
    assert measure({BASELINE: steady, "ring": itertools.repeat(2e-5)}, 7, 21) == {
        BASELINE: 7,
        "ring": 7,
    }
    noisy = itertools.cycle([2e-5, 4e-5, 2e-5, 6e-5])  # (quartiles 2 and 4.5: never settled)
    got = measure({BASELINE: itertools.repeat(1e-5), "ring": noisy, "auto": steady}, 7, 21)
    assert got == {BASELINE: 21, "ring": 21, "auto": 7}
    assert measure({BASELINE: itertools.repeat(1e-5), "ring": noisy}, 5, 5) == {
        BASELINE: 5,
        "ring": 5,
    }
