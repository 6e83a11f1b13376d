"""fedssl.experiments.table_runner: resume, crash safety of the cell store, progress / ETA, output files."""

import csv
import functools
import json
import platform

import pytest
import torch

from fedssl.experiments import environment as env_mod
from fedssl.experiments.table_runner import (
    CellStore,
    check_run_config,
    error_bar,
    few_seeds_note,
    format_duration,
    key_id,
    plot_table,
    run_cells,
    seed_values,
    write_run_config,
    write_table,
)

torch.set_num_threads(1)

CELLS = [{"method": m, "n": n} for m in ("random", "FCL") for n in (1, 2)]


#: a trivial module-level cell, picklable for the worker processes, from a module they import at once (json)
AS_TEXT = functools.partial(json.dumps, sort_keys=True)


def test_key_identity_ignores_order_and_refuses_non_scalars():
    assert key_id({"a": 1, "b": "x"}) == key_id({"b": "x", "a": 1})
    with pytest.raises(ValueError, match="scalars"):
        key_id({"a": [1, 2]})


def test_resume_runs_exactly_the_missing_cells_and_returns_cell_order(tmp_path):
    store = CellStore(tmp_path / "cells.jsonl")
    store.put(CELLS[3], {"value": 99}, 1.0)  # finished out of order: results must still come in cell order
    store.put(CELLS[0], {"value": 98}, 1.0)
    called = []

    def fn(key):
        called.append(key)
        return {"value": key["n"]}

    lines = []
    results = run_cells(CELLS, fn, CellStore(tmp_path / "cells.jsonl"), say=lines.append)
    assert called == [CELLS[1], CELLS[2]]
    assert results == [{"value": 98}, {"value": 2}, {"value": 1}, {"value": 99}]
    assert "4 cells, 2 already done" in lines[0] and "2 to run" in lines[0]
    assert run_cells(CELLS, fn, CellStore(tmp_path / "cells.jsonl"), say=lines.append) == results
    assert len(called) == 2  # a third run re-runs nothing


def test_torn_last_line_is_ignored_with_a_warning_and_cut_off_before_the_next_append(tmp_path):
    path = tmp_path / "cells.jsonl"
    CellStore(path).put(CELLS[0], {"value": 1}, 2.0)
    with open(path, "a") as f:
        f.write('{"key": {"method": "random", "n": 2}, "resu')  # killed mid-write
    with pytest.warns(UserWarning, match=r"cells\.jsonl.*line 2.*incomplete"):
        store = CellStore(path)
    assert store.done(CELLS[0]) and not store.done(CELLS[1])
    store.put(CELLS[1], {"value": 4}, 1.0)
    assert [r["key"] for r in CellStore(path).results()] == CELLS[:2]  # reads back clean


def test_matching_needs_every_field_with_its_value_and_type(tmp_path):
    store = CellStore(tmp_path / "cells.jsonl")
    for i, key in enumerate([{"stage": "local", "n": 1}, {"stage": "local", "n": 1, "seed": 1},
                             {"stage": "diagnostics", "n": 2}, {"stage": "local", "n": True}]):
        store.put(key, i, 1.0)
    assert [r["result"] for r in store.matching({"stage": "local", "n": 1})] == [0, 1]  # True is not 1
    assert [r["result"] for r in store.matching({"seed": 1})] == [1]  # a key without the field never matches
    assert [r["result"] for r in store.matching({"n": True})] == [3]
    assert store.matching({"stage": "federated"}) == []
    with pytest.raises(ValueError, match="at least one key field"):
        store.matching({})


def test_forget_moves_cells_aside_and_the_next_run_computes_exactly_them(tmp_path):
    path = tmp_path / "cells.jsonl"
    run_cells(CELLS, lambda key: {"value": key["n"]}, CellStore(path), say=lambda line: None)
    with open(path, "a") as f:
        f.write('{"key": {"method": "x", "n": 9}, "resu')  # a torn last line: the rewrite drops it
    with pytest.warns(UserWarning, match="incomplete"):
        store = CellStore(path)
    gone = store.forget({"method": "FCL"})
    assert [r["key"] for r in gone] == CELLS[2:]
    assert [r["key"] for r in CellStore(path).results()] == CELLS[:2]  # the file, read again, lacks them
    forgotten = tmp_path / "cells.forgotten.jsonl"
    assert [json.loads(line)["key"] for line in forgotten.read_text().splitlines()] == CELLS[2:]
    assert not (tmp_path / "cells.jsonl.tmp").exists()
    store.put({"method": "x", "n": 9}, {"value": 9}, 1.0)  # the same store appends after the rewrite: no stale cut
    assert [r["key"] for r in CellStore(path).results()] == [*CELLS[:2], {"method": "x", "n": 9}]
    store.forget({"method": "x"})
    called = []
    results = run_cells(CELLS, lambda key: called.append(key) or {"value": 10 * key["n"]}, CellStore(path),
                        say=lambda line: None)
    assert called == CELLS[2:] and results == [{"value": 1}, {"value": 2}, {"value": 10}, {"value": 20}]
    CellStore(path).forget({"method": "FCL", "n": 2})  # a second forget appends: both old results are kept
    assert [json.loads(line)["result"] for line in forgotten.read_text().splitlines()] == [
        {"value": 1}, {"value": 2}, {"value": 9}, {"value": 20}]
    assert CellStore(path).forget({"method": "none"}) == [] and len(CellStore(path).results()) == 3


def test_forget_never_writes_through_a_link_and_keeps_repeated_lines(tmp_path):
    """Issue 45 item 10: a symlinked cells.jsonl.tmp made forget overwrite the file it pointed at, and a repeated
    line vanished from both files.  Now the link is removed, not followed; a repeated line of a kept cell stays in
    the store and one of a forgotten cell goes with it to the forgotten file."""
    path = tmp_path / "cells.jsonl"
    run_cells(CELLS, lambda key: {"value": key["n"]}, CellStore(path), say=lambda line: None)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[0], lines[2]]) + "\n")  # random n=1 and FCL n=1 twice
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    (tmp_path / "cells.jsonl.tmp").symlink_to(victim)
    with pytest.warns(UserWarning, match="repeats cell"):
        store = CellStore(path)
    store.forget({"method": "FCL"})
    assert victim.read_text() == "someone else's file\n"
    assert path.read_text().splitlines() == [lines[0], lines[1], lines[0]]
    forgotten = (tmp_path / "cells.forgotten.jsonl").read_text().splitlines()
    assert forgotten == [lines[2], lines[3], lines[2]]


def test_record_without_its_newline_is_kept_and_the_next_one_starts_a_new_line(tmp_path):
    path = tmp_path / "cells.jsonl"
    path.write_text(json.dumps({"key": CELLS[0], "result": 1, "seconds": 1.0}))  # no trailing newline
    store = CellStore(path)
    store.put(CELLS[1], 2, 1.0)
    assert [r["result"] for r in CellStore(path).results()] == [1, 2]


def test_corrupt_middle_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "cells.jsonl"
    good = [json.dumps({"key": k, "result": 1, "seconds": 1.0}) for k in CELLS[:2]]
    path.write_text(good[0] + "\n" + "{not json\n" + good[1] + "\n")
    with pytest.raises(ValueError, match=r"cells\.jsonl, line 2"):
        CellStore(path)


def test_failing_cell_is_not_recorded_and_reraises(tmp_path):
    path = tmp_path / "cells.jsonl"

    def fn(key):
        if key == CELLS[2]:
            raise RuntimeError("out of memory")
        return {"value": key["n"]}

    lines = []
    with pytest.raises(RuntimeError, match="out of memory"):
        run_cells(CELLS, fn, CellStore(path), say=lines.append)
    store = CellStore(path)
    assert [store.done(k) for k in CELLS] == [True, True, False, False]
    assert "method=FCL n=1 FAILED" in lines[-1] and "re-run resumes" in lines[-1]


def test_progress_lines_count_cells_and_eta_weighted_by_cost(tmp_path):
    ticks = iter([0.0, 10.0, 10.0, 40.0, 40.0, 50.0])  # cells of cost 2, 1, 2 take 10 s, 30 s, 10 s
    store = CellStore(tmp_path / "cells.jsonl")
    store.put(CELLS[0], 0, 1.0)
    lines = []
    run_cells(CELLS, lambda k: k["n"], store, say=lines.append, cost=lambda k: k["n"], clock=lambda: next(ticks))
    # after cell 2 (cost 2, 10 s): 5 s per cost unit, 1 + 2 units left -> 15 s
    assert lines[1] == "[2/4] method=random n=2 took 10.0 s | ETA 15 s"
    # after cell 3 (cost 1, 30 s): 40 s over 3 units, 2 units left -> 26.7 s
    assert lines[2] == "[3/4] method=FCL n=1 took 30.0 s | ETA 27 s"
    assert lines[3] == "[4/4] method=FCL n=2 took 10.0 s | all done"


def test_format_duration():
    assert [format_duration(s) for s in (12.3, 250, 3900)] == ["12 s", "4 min 10 s", "1 h 05 min"]


def test_two_workers_give_the_same_store_as_one(tmp_path):
    one = run_cells(CELLS, AS_TEXT, CellStore(tmp_path / "one.jsonl"), say=lambda s: None)
    lines = []
    two = run_cells(CELLS, AS_TEXT, CellStore(tmp_path / "two.jsonl"), say=lines.append, workers=2)
    assert one == two == [json.dumps(k, sort_keys=True) for k in CELLS]
    stored = {key_id(r["key"]): r["result"] for r in CellStore(tmp_path / "two.jsonl").results()}
    assert stored == {key_id(r["key"]): r["result"] for r in CellStore(tmp_path / "one.jsonl").results()}
    assert "on 2 worker processes" in lines[0] and lines[-1].startswith("[4/4]")


ROWS = [  # two methods x two columns, e.g. per-site values (0.2, 0.4) -> mean 0.3, std 0.1 (population)
    {"table": "t1", "method": "random", "column": "N=1", "mean": 0.3, "std": 0.1, "n": 2},
    {"table": "t1", "method": "random", "column": "N=2", "mean": 0.5, "std": 0.05, "n": 2},
    {"table": "t1", "method": "FCL", "column": "N=1", "mean": 0.45, "std": 0.0, "n": 2},
    {"table": "t1", "method": "FCL", "column": "N=2", "mean": 0.62, "std": 0.02, "n": 2},
]
PAPER = [{"method": "random", "column": "N=1", "mean": 0.280, "std": 0.037},
         {"method": "FCL", "column": "N=1", "mean": 0.506, "std": 0.056}]


def test_write_table_files(tmp_path):
    paths = write_table(tmp_path, "table1", ROWS, title="Table 1 (local)", paper=PAPER,
                        paper_source="FCL, Wu et al., MedIA 2022, Table 1", notes=["folds 0-2"],
                        footer=["FCL minus random: N=1 +0.150"])
    data = json.loads(open(paths["json"]).read())
    assert data["rows"] == ROWS and data["paper"]["rows"] == PAPER and data["notes"] == ["folds 0-2"]
    assert data["footer"] == ["FCL minus random: N=1 +0.150"]
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [(r["source"], r["method"], r["column"], r["mean"], r["std"], r["n"]) for r in rows[:2]] == [
        ("bundle", "random", "N=1", "0.3", "0.1", "2"), ("bundle", "random", "N=2", "0.5", "0.05", "2")]
    assert (rows[-1]["source"], rows[-1]["method"], rows[-1]["mean"]) == ("paper", "FCL", "0.506")
    text = open(paths["txt"]).read()
    bundle, paper = text.split("paper (FCL, Wu et al., MedIA 2022, Table 1)")
    assert "random  0.300 +- 0.100  0.500 +- 0.050" in bundle
    assert "FCL     0.450 +- 0.000  0.620 +- 0.020" in bundle
    assert "random  0.280 +- 0.037  -" in paper and "FCL     0.506 +- 0.056  -" in paper
    assert bundle.index("folds 0-2") < bundle.index("random  0.300")  # notes under the title
    assert paper.rstrip().endswith("\n\nFCL minus random: N=1 +0.150")  # the footer under both tables
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_error_bars_are_the_std_over_seeds_where_a_row_has_several():
    row = {"method": "FCL", "column": "N=1", "mean": 0.5, "std": 0.01, "by_seed": {"10": 0.9, "2": 0.4, "0": 0.2}}
    assert seed_values(row) == [0.2, 0.4, 0.9]  # seeds in numeric order, not text order
    half, kind = error_bar(row)
    assert kind == "seeds" and half == pytest.approx(0.13 ** 0.5)  # deviations -0.3, -0.1, +0.4: 0.26 / 2
    assert error_bar({**row, "by_seed": {"0": 0.2}}) == (0.01, "units")  # one seed: the row's std
    assert error_bar({"mean": 0.5, "std": None}) == (0.0, "units")


def test_the_figure_draws_each_seed_and_says_what_its_bars_are(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, dpi=None: saved.append(fig))
    rows = [{"method": m, "column": c, "mean": 0.5, "std": 0.01, "by_seed": {"0": 0.4, "1": 0.5, "2": 0.6}}
            for m in ("random", "FCL") for c in ("N=1", "N=2")]
    plot_table(rows, str(tmp_path / "f.png"), title="t")
    ax = saved[0].axes[0]
    dots = [ln for ln in ax.get_lines() if ln.get_marker() == "." and ln.get_linestyle() == "None"]
    assert len(dots) == 4 and all(sorted(ln.get_ydata()) == [0.4, 0.5, 0.6] for ln in dots)
    assert ax.get_ylabel() == "dice (error bars: std over seeds, dots: each seed)"
    saved.clear()
    plot_table([{k: v for k, v in r.items() if k != "by_seed"} for r in rows], str(tmp_path / "g.png"), title="t")
    assert saved[0].axes[0].get_ylabel() == "dice (error bars: std)"


def test_a_rows_mark_follows_its_label_in_the_bundle_block_and_the_legend_not_in_the_papers(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, dpi=None: saved.append(fig))
    rows = [dict(r, mark=" [failed pre-training]") if r["method"] == "FCL" else r for r in ROWS]
    paths = write_table(tmp_path, "t", rows, title="T", paper=PAPER, paper_source="FCL, Table 1")
    bundle, paper = open(paths["txt"]).read().split("paper (FCL, Table 1)")
    assert "FCL [failed pre-training]  0.450 +- 0.000  0.620 +- 0.020" in bundle
    assert "random                     0.300 +- 0.100" in bundle
    assert "FCL     0.506 +- 0.056  -" in paper  # matched by the plain label
    legend = [t.get_text() for t in saved[0].axes[0].get_legend().get_texts()]
    assert {"random", "FCL [failed pre-training]", "FCL (paper)"} <= set(legend) and "FCL" not in legend


def test_write_table_without_paper_has_no_paper_block_and_paper_needs_a_source(tmp_path):
    paths = write_table(tmp_path, "t", ROWS, title="T")
    assert "paper (" not in open(paths["txt"]).read()
    with pytest.raises(ValueError, match="paper_source"):
        write_table(tmp_path, "t", ROWS, title="T", paper=PAPER)


def test_failing_cell_in_a_worker_is_not_recorded_and_reraises_after_running_cells_are_stored(tmp_path):
    from tests.unit.experiments.cell_fns import sleep_or_fail

    # the failure comes first; the other cell is still running then and its result must not be lost
    cells = [{"n": 1, "sleep": 1.0}, {"n": 2, "fail": True}]
    lines = []
    with pytest.raises(KeyError, match="fails on purpose"):
        run_cells(cells, sleep_or_fail, CellStore(tmp_path / "c.jsonl"), say=lines.append, workers=2)
    store = CellStore(tmp_path / "c.jsonl")
    assert store.done(cells[0]) and store.get(cells[0]) == 1 and not store.done(cells[1])
    assert any("n=2 fail=True FAILED" in line for line in lines)


def test_check_run_config_records_then_refuses_changed_or_unreadable_settings(tmp_path):
    out = str(tmp_path / "run")
    check_run_config(out, {"profile": "bench", "epochs": 60})
    check_run_config(out, {"profile": "bench", "epochs": 60})  # same settings: resume
    with pytest.raises(ValueError, match=r"run_config\.json: .*epochs=60 \(now 3\)"):
        check_run_config(out, {"profile": "bench", "epochs": 3})
    with pytest.raises(ValueError, match=r"seeds=None \(now \[0\]\)"):  # a setting the first run did not have
        check_run_config(out, {"profile": "bench", "epochs": 60, "seeds": [0]})
    (tmp_path / "run" / "run_config.json").write_text("{torn")
    with pytest.raises(ValueError, match="run_config.json is unreadable"):
        check_run_config(out, {"profile": "bench", "epochs": 60})


def test_collected_selectors_are_recorded_as_their_union_and_never_refused(tmp_path):
    out = str(tmp_path / "run")
    check_run_config(out, {"profile": "bench", "seeds": [2, 0]}, collected=("seeds",))
    check_run_config(out, {"profile": "bench", "seeds": [1]}, collected=("seeds",))  # a seed added: resumes
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["seeds"] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"profile='bench' \(now 'quick'\)"):  # the other settings still checked
        check_run_config(out, {"profile": "quick", "seeds": [0]}, collected=("seeds",))


def test_a_run_config_that_is_not_an_object_is_refused_by_name(tmp_path):
    (tmp_path / "run_config.json").write_text("[1, 2]")  # valid JSON, but a hand-edited list, not settings
    with pytest.raises(ValueError, match=r"run_config\.json is unreadable \(a JSON list, not an object"):
        check_run_config(str(tmp_path), {"profile": "bench"})


def test_a_later_setting_resumes_an_older_folder_only_at_the_value_every_older_run_had(tmp_path):
    """FedDRA's device_rate came later, at 0 for every run before it: an older folder resumes at 0 (recorded from
    then on) and is refused at any other rate, since its cells were computed without devices."""
    out = str(tmp_path / "run")
    check_run_config(out, {"turns": 25})  # a FedDRA folder from before device_rate
    with pytest.raises(ValueError, match=r"device_rate=None \(now 0\.3\)"):
        check_run_config(out, {"turns": 25, "device_rate": 0.3}, say=lambda m: None)
    said = []
    check_run_config(out, {"turns": 25, "device_rate": 0.0}, say=said.append)
    assert said == [f"{out}/run_config.json: device_rate=0.0 recorded from now on (the cells already there were "
                    "computed before it was recorded)"]
    with pytest.raises(ValueError, match=r"device_rate=0\.0 \(now 0\.3\)"):  # recorded: it must match
        check_run_config(out, {"turns": 25, "device_rate": 0.3}, say=said.append)


ENV = {"threads": 1, "torch": "2.4.1", "nvflare": "2.9.0", "monai": "1.5.0", "numpy": "2.1.0", "python": "3.11.7",
       "cpu": "AMD EPYC", "cpu_count": 2, "blas": "BLAS mkl", "env": {}}


def test_thread_count_is_a_setting_named_with_its_fix_and_an_older_folder_without_it_resumes(tmp_path):
    out = str(tmp_path / "run")
    check_run_config(out, {"profile": "bench"})  # a folder from before threads were recorded
    said = []
    check_run_config(out, {"profile": "bench", "threads": 1}, env=ENV, say=said.append)
    assert said == [f"{out}/run_config.json: threads=1 recorded from now on (the cells already there were computed "
                    "before it was recorded)"]
    config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert config == {"profile": "bench", "threads": 1, "environments": [ENV]}
    check_run_config(out, {"profile": "bench", "threads": 1}, env=ENV, say=said.append)  # the same: quiet resume
    assert len(said) == 1
    with pytest.raises(ValueError, match=r"threads=1 \(now 2\); re-run with the same settings to resume, or use "
                                         r"another --out \(threads: pass --threads 1 to resume this folder\)"):
        check_run_config(out, {"profile": "bench", "threads": 2}, env=ENV, say=said.append)


def test_another_environment_resumes_with_a_warning_and_is_added_to_the_record(tmp_path):
    out = str(tmp_path / "run")
    settings = {"profile": "bench", "threads": 1}
    check_run_config(out, settings, env=ENV, say=pytest.fail)
    newer = {**ENV, "torch": "2.5.0", "env": {"OMP_NUM_THREADS": "1"}}
    said = []
    check_run_config(out, settings, env=newer, say=said.append)  # versions differ: not refused
    assert len(said) == 1 and said[0].startswith(f"warning: {out}/run_config.json: this run's environment differs")
    assert "env {} -> {'OMP_NUM_THREADS': '1'}, torch 2.4.1 -> 2.5.0" in said[0]
    check_run_config(out, settings, env=newer, say=said.append)  # seen before: recorded once, no second warning
    check_run_config(out, settings, env=ENV, say=said.append)  # back to the first: known, quiet
    assert len(said) == 1
    config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert config["environments"] == [ENV, newer] and config["threads"] == 1
    with pytest.raises(ValueError, match="record of environments, not a setting"):
        check_run_config(out, {**settings, "environments": []})


def test_environment_names_versions_cpu_blas_and_the_thread_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MKL_DYNAMIC", "FALSE")
    env = env_mod.environment()
    assert env["threads"] == torch.get_num_threads() and env["torch"] == torch.__version__
    assert env["env"]["OMP_NUM_THREADS"] == "3" and env["env"]["MKL_DYNAMIC"] == "FALSE"
    assert env["python"].count(".") == 2 and env["cpu"] and env["blas"]
    assert json.loads(json.dumps(env)) == env  # JSON as it is
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t\t: avx2\n")
    assert env_mod.cpu_model(str(cpuinfo)) == "Test CPU @ 2.0GHz"
    assert env_mod.cpu_model(str(tmp_path / "none")) == (platform.processor() or platform.machine() or "unknown")
    config = ("  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605\n"
              "  - CPU capability usage: AVX2\n  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, "
              "LAPACK_INFO=mkl, ")
    assert env_mod.blas(config) == ("BLAS mkl, LAPACK mkl (Intel(R) oneAPI Math Kernel Library Version "
                                    "2024.2-Product Build 20240605), CPU capability AVX2")
    assert env_mod.blas("nothing said") == "unknown"
    with pytest.raises(ValueError, match=r"threads=0 is invalid; use an int >= 1"):
        env_mod.check_threads(0)


def test_a_demo_writes_its_settings_threads_and_environment(tmp_path):
    path = write_run_config(str(tmp_path / "demo"), {"demo": "fcl", "rounds": 2}, threads=1)
    config = json.loads(open(path).read())
    assert config["demo"] == "fcl" and config["threads"] == 1
    assert [e["threads"] for e in config["environments"]] == [torch.get_num_threads()]


def test_cells_compute_at_the_given_thread_count_here_and_in_every_worker(tmp_path):
    from tests.unit.experiments.cell_fns import torch_threads

    lines = []
    cells = [{"n": 1}, {"n": 2}]
    try:
        assert run_cells(cells[:1], torch_threads, CellStore(tmp_path / "one.jsonl"), say=lines.append,
                         threads=2) == [2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    # each worker sets the count before the caller's initializer and its cells
    assert run_cells(cells, torch_threads, CellStore(tmp_path / "two.jsonl"), say=lines.append, workers=2,
                     threads=3) == [3, 3]
    assert any("on 2 worker processes (3 torch threads each)" in line for line in lines)
    with pytest.raises(ValueError, match="threads=0 is invalid"):
        run_cells(cells, torch_threads, CellStore(tmp_path / "x.jsonl"), threads=0)


def test_few_seeds_note_names_the_rows_of_fewer_than_three_seeds():
    spread = "(a method's sign can change from one seed to the next)"
    assert few_seeds_note({"random": [0], "FCL": [0]}) == f"one seed (0): not a finding; run --seeds 0 1 2 {spread}"
    assert (few_seeds_note({"random": [0, 1], "FCL": [1, 0]}, rerun="X")
            == f"two seeds (0, 1): not a finding; run X {spread}")
    assert few_seeds_note({"random": [0, 1, 2], "FedMoCo": [0], "FCL": [0, 1, 2], "none": []}) == (
        f"FedMoCo: one seed (0): not a finding; run --seeds 0 1 2 {spread}")
    assert few_seeds_note({"random": [0, 1, 2], "FCL": [2, 3, 4]}) is None
