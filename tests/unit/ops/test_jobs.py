"""fedssl.ops.jobs: every override is checked against the constructor of the component it targets (name, JSON type,
full binding) before anything is written, and a job folder is replaced only by a complete new one."""

from __future__ import annotations

import json
import os
from typing import Sequence

import pytest

from fedssl.ops import jobs
from fedssl.ops.jobs import REPO_ROOT, build_job, check_argument, check_binds, component_specs, configured_job

FCL = os.path.join(REPO_ROOT, "jobs", "fcl_acdc")
SAG = "server.scatter_and_gather"
TRAINER = "client.fcl_trainer"


class Widget:
    """A constructor with one argument of every kind the check knows (the test's own component class)."""

    def __init__(self, n: int, x: float = 0.0, flag: bool = False, name: str = "", maybe: float | None = None,
                 seq: Sequence[int] = (), pair: tuple[int, str] = (0, ""), table: dict[str, int] | None = None,
                 free=""):
        self.n = n


class Gadget(Widget):
    """Hands ``**kwargs`` on to Widget, as FCLOptController does to ScatterAndGather."""

    def __init__(self, mode: str = "a", **kwargs):
        super().__init__(**kwargs)


def _comp(cls: type, **args) -> dict:
    return {"id": "w", "path": f"{__name__}.{cls.__name__}", "args": args}


@pytest.mark.parametrize("arg, value, ok", [
    ("n", 3, True), ("n", 3.0, False), ("n", True, False), ("n", "3", False), ("n", None, False),
    ("x", 1, True), ("x", 0.5, True), ("x", False, False), ("x", "0.5", False),
    ("flag", False, True), ("flag", 0, False), ("name", "a", True), ("name", 1, False),
    ("maybe", None, True), ("maybe", 2, True), ("maybe", "2", False),
    ("seq", [1, 2], True), ("seq", [1, "2"], False), ("seq", "12", False), ("seq", {"a": 1}, False),
    ("pair", [1, "a"], True), ("pair", [1, 2], False), ("pair", [1], False),
    ("table", {"a": 1}, True), ("table", {"a": "1"}, False), ("table", [1], False), ("table", None, True),
    ("free", {"site-1": "nih"}, True), ("free", 7, True),  # no annotation: the constructor decides
    ("n", {"path": "some.Class", "args": {}}, True),  # a nested component FLARE builds first
])
def test_json_type_must_fit_the_annotation(arg, value, ok):
    comp = _comp(Widget, n=1)
    if ok:
        check_argument(comp, arg, value, "job/app")
    else:
        with pytest.raises(ValueError, match=rf"job/app: component 'w' \(.*Widget\): argument {arg}="):
            check_argument(comp, arg, value, "job/app")


def test_non_finite_numbers_are_refused_anywhere_in_a_value():
    for value in (float("nan"), float("inf"), [1.0, float("-inf")]):
        with pytest.raises(ValueError, match="is not a finite number"):
            check_argument(_comp(Widget, n=1), "seq" if isinstance(value, list) else "x", value, "job/app")


def test_names_follow_kwargs_to_the_base_class_and_unknown_ones_list_the_accepted():
    comp = _comp(Gadget, n=1)
    check_argument(comp, "mode", "b", "job/app")
    check_argument(comp, "n", 2, "job/app")  # Widget's, through **kwargs
    with pytest.raises(ValueError, match=r"int"):
        check_argument(comp, "n", "two", "job/app")
    with pytest.raises(ValueError, match=r"has no argument 'm0de'; it accepts \['flag', 'free', 'maybe', 'mode', "
                                         r"'n', 'name', 'pair', 'seq', 'table', 'x'\]"):
        check_argument(comp, "m0de", "b", "job/app")


def test_a_missing_required_argument_is_reported_and_a_path_that_is_no_class_refused():
    check_binds(_comp(Widget, n=1), "job/app")
    with pytest.raises(ValueError, match="missing a required argument: 'n'"):
        check_binds(_comp(Widget, x=1.0), "job/app")
    with pytest.raises(ValueError, match="is not a class"):
        check_argument({"id": "f", "path": "fedssl.ops.jobs.build_job", "args": {}}, "job_dir", "x", "job/app")
    with pytest.raises(ValueError, match="does not import"):
        check_argument({"id": "f", "path": "fedssl.nothing.Here", "args": {}}, "a", 1, "job/app")


@pytest.mark.parametrize("override, arg, declared", [
    (f"{SAG}.num_rounds=five", "num_rounds", "int"),  # a FLARE component, from its own signature
    (f"{SAG}.ignore_result_error=1", "ignore_result_error", "bool"),
    (f"{TRAINER}.lr=abc", "lr", "float"),
    (f"{TRAINER}.image_size=64.0", "image_size", "int"),
    (f"{TRAINER}.feature_exchange=1", "feature_exchange", "bool"),
    (f"{TRAINER}.features=8", "features", "list"),
])
def test_wrong_override_types_are_errors_before_anything_is_written(tmp_path, override, arg, declared):
    with pytest.raises(ValueError, match=rf"\(--set\): component '\w+' \(.*\): argument {arg}=.* takes {declared}"):
        build_job(FCL, str(tmp_path / "j"), sets=[override])
    assert os.listdir(tmp_path) == []


def test_fitting_overrides_are_written_including_constructor_args_the_job_does_not_list(tmp_path):
    out = build_job(FCL, str(tmp_path / "j"), sets=[f"{TRAINER}.lr=1", f"{SAG}.persist_every_n_rounds=2",
                                                   f"{TRAINER}.feature_exchange=false"])
    comps = {c["id"]: c for _, cfg in jobs.job_configs(out) for c in component_specs(cfg)}
    assert comps["fcl_trainer"]["args"]["lr"] == 1 and comps["fcl_trainer"]["args"]["feature_exchange"] is False
    assert comps["scatter_and_gather"]["args"]["persist_every_n_rounds"] == 2
    with pytest.raises(ValueError, match=r"'fcl_trainer' \(fedssl.flare.fcl_executor.FCLExecutor\) has no argument "
                                         r"'lrr'; it accepts \[.*'lr'.*\]"):
        build_job(FCL, str(tmp_path / "k"), sets=[f"{TRAINER}.lrr=1"])


def test_profile_values_and_parts_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"jobs": {"*": {"server": {"scatter_and_gather": {"num_rounds": "2"}}}}}))
    with pytest.raises(ValueError, match=r"\(profile\): component 'scatter_and_gather' .* num_rounds='2'"):
        configured_job(FCL, profile=str(bad))
    bad.write_text(json.dumps({"jobs": {"fcl_acdc": {"clinet": {"fcl_trainer": {"lr": 0.1}}}}}))
    with pytest.raises(ValueError, match="'clinet' must be one of"):
        configured_job(FCL, profile=str(bad))
    bad.write_text("{")
    with pytest.raises(ValueError, match=f"{bad}: not valid JSON"):
        configured_job(FCL, profile=str(bad))


def test_meta_keys_and_site_counts_are_checked():
    for sets, n_sites, match in ((["meta.min_clients=0"], None, "min_clients=0 is invalid"),
                                 (["meta.min_clients=two"], None, "meta min_clients='two' is a string"),
                                 (["meta.min_client=2"], None, "meta key 'min_client' cannot be set"),
                                 ([], 0, "n_sites=0 is invalid"), ([], -3, "n_sites=-3 is invalid")):
        with pytest.raises(ValueError, match=match):
            configured_job(FCL, sets=sets, n_sites=n_sites)
    assert configured_job(FCL, sets=["meta.min_clients=2"], n_sites=3)["meta.json"]["min_clients"] == 2


def _snapshot(folder) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, f), folder): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(folder) for f in fs}


def test_a_failed_build_leaves_the_previous_folder_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "fcl_acdc"
    build_job(FCL, str(out), profile="quick")
    good = _snapshot(out)
    with pytest.raises(ValueError, match="lrr"):  # an override error
        build_job(FCL, str(out), sets=[f"{TRAINER}.lrr=1"])
    assert _snapshot(out) == good and os.listdir(tmp_path) == ["fcl_acdc"]

    real_dump, calls = json.dump, []

    def dump_then_fail(obj, f, **kw):  # the disk fills up after the first file
        calls.append(f.name)
        if len(calls) > 1:
            raise OSError(28, "No space left on device", f.name)
        real_dump(obj, f, **kw)

    monkeypatch.setattr(json, "dump", dump_then_fail)
    with pytest.raises(OSError, match="No space left"):
        build_job(FCL, str(out), sets=[f"{SAG}.num_rounds=7"])
    monkeypatch.undo()
    assert _snapshot(out) == good and os.listdir(tmp_path) == ["fcl_acdc"]

    real_rename = os.rename

    def rename_in_fails(src, dst):  # moving the new folder in fails: the old one goes back
        if ".new-" in os.path.basename(src):
            raise OSError(16, "Device or resource busy", src, None, dst)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_in_fails)
    with pytest.raises(OSError, match="busy"):
        build_job(FCL, str(out), sets=[f"{SAG}.num_rounds=7"])
    monkeypatch.undo()
    assert _snapshot(out) == good and os.listdir(tmp_path) == ["fcl_acdc"]


def test_a_successful_build_replaces_the_whole_previous_folder(tmp_path):
    out = tmp_path / "fcl_acdc"
    build_job(FCL, str(out), profile="quick")
    (out / "stale.txt").write_text("from an older build")
    build_job(FCL, str(out), sets=[f"{SAG}.num_rounds=7"])
    sag = [c for _, cfg in jobs.job_configs(str(out)) for c in component_specs(cfg) if c["id"] == "scatter_and_gather"]
    assert sag[0]["args"]["num_rounds"] == 7 and not (out / "stale.txt").exists()
    assert os.listdir(tmp_path) == ["fcl_acdc"]
    assert oct(os.stat(out).st_mode & 0o777) == oct(os.stat(FCL).st_mode & 0o777)  # not mkdtemp's 0700


def test_destinations_that_are_not_a_built_job_are_never_replaced(tmp_path):
    (tmp_path / "file").write_text("keep")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "scan.nii.gz").write_text("keep")
    os.symlink(tmp_path / "data", tmp_path / "link")
    for dst, match in ((tmp_path / "file", "exists and is not a folder"),
                       (tmp_path / "link", "exists and is not a folder"),
                       (tmp_path / "data", r"is not a job folder \(no meta.json\), so it is not replaced"),
                       (FCL, "must not be the job folder"), (os.path.join(FCL, "app", "x"), "must not be the job"),
                       (os.path.dirname(FCL), "must not be the job folder")):
        with pytest.raises(ValueError, match=match):
            build_job(FCL, str(dst))
    with pytest.raises(NotADirectoryError, match="is not a folder") as e:
        build_job(FCL, str(tmp_path / "file" / "job"))
    assert e.value.filename == str(tmp_path / "file")
    assert (tmp_path / "file").read_text() == (tmp_path / "data" / "scan.nii.gz").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    build_job(FCL, str(tmp_path / "empty"))  # an empty folder is fine
    assert (tmp_path / "empty" / "meta.json").is_file()


def test_a_profile_extends_another_by_deep_merge(tmp_path):
    """``"extends"``: the base profile with this one's keys merged in (objects key by key, other values replace);
    the bench profile is quick plus more pre-training."""
    from fedssl.ops.jobs import load_profile

    base = {"description": "b", "finetune": {"epochs": 60, "lr": 0.005},
            "jobs": {"j": {"server": {"s": {"num_rounds": 2, "min_clients": 3}}}}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    child = {"extends": str(tmp_path / "base.json"), "finetune": {"epochs": 30},
             "jobs": {"j": {"server": {"s": {"num_rounds": 40}}}}, "tables": {"fcl": {"folds": {"2": [0]}}}}
    (tmp_path / "child.json").write_text(json.dumps(child))
    got = load_profile(str(tmp_path / "child.json"))
    assert got == {"description": "b", "finetune": {"epochs": 30, "lr": 0.005},
                   "jobs": {"j": {"server": {"s": {"num_rounds": 40, "min_clients": 3}}}},
                   "tables": {"fcl": {"folds": {"2": [0]}}}}
    bench, quick = load_profile("bench"), load_profile("quick")
    assert bench["finetune"] == quick["finetune"]
    assert bench["jobs"]["fcl_acdc"]["server"]["scatter_and_gather"]["num_rounds"] > \
        quick["jobs"]["fcl_acdc"]["server"]["scatter_and_gather"]["num_rounds"]
    assert bench["jobs"]["fcl_acdc"]["shape"]["image_size"] == 64  # inherited from quick


def test_a_cycle_of_extends_is_an_error(tmp_path):
    from fedssl.ops.jobs import load_profile

    (tmp_path / "a.json").write_text(json.dumps({"extends": str(tmp_path / "b.json")}))
    (tmp_path / "b.json").write_text(json.dumps({"extends": str(tmp_path / "a.json")}))
    with pytest.raises(ValueError, match="cycle"):
        load_profile(str(tmp_path / "a.json"))


def _filter_ids(config: dict, chain: str) -> list:
    return [(sorted(e["tasks"]), [f["id"] for f in e["filters"]]) for e in config.get(chain, [])]


@pytest.mark.parametrize("job", sorted(d for d in os.listdir(os.path.join(REPO_ROOT, "jobs"))
                                     if os.path.isfile(os.path.join(REPO_ROOT, "jobs", d, "meta.json"))))  # not *.md
def test_the_wire_switch_puts_the_filters_between_the_meters_and_the_rest_in_every_job(job):
    files = configured_job(os.path.join(REPO_ROOT, "jobs", job), sets=["wire.weights=float16"])
    server = next(v for k, v in files.items() if k.endswith("config_fed_server.json"))
    client = next(v for k, v in files.items() if k.endswith("config_fed_client.json"))
    data = {tuple(t): ids for t, ids in _filter_ids(client, "task_data_filters")}
    result = {tuple(t): ids for t, ids in _filter_ids(client, "task_result_filters")}
    downloads = uploads = 0
    for tasks, ids in _filter_ids(server, "task_data_filters"):
        meter = next((i for i in ids if i.startswith("meter_download")), None)
        if meter:  # the quantiser right before the download meter: the meter counts what travels
            assert ids[ids.index(meter) - 1] == "wire_quantizer" and data[tuple(tasks)][0] == "wire_dequantizer"
            downloads += 1
    for tasks, ids in _filter_ids(server, "task_result_filters"):
        if "meter_upload" in ids:  # the dequantiser right after the upload meter, before anything reads the weights
            assert (ids[ids.index("meter_upload") + 1] == "wire_dequantizer"
                    and result[tuple(tasks)][-1] == "wire_quantizer")
            uploads += 1
    assert downloads and uploads


def test_wire_settings_are_checked_and_banks_precede_the_quantiser():
    files = configured_job(FCL, sets=["wire.weights=adaquant", "wire.banks=float16"])
    server = files["app/config/config_fed_server.json"]
    assert _filter_ids(server, "task_data_filters") == [(["train"], ["bank_shuttle", "wire_banks", "wire_quantizer",
                                                                     "meter_download"])]
    client = files["app/config/config_fed_client.json"]
    assert _filter_ids(client, "task_result_filters") == [(["train"], ["wire_banks", "wire_quantizer"])]
    quantizer = client["task_result_filters"][0]["filters"][1]
    assert quantizer["args"] == {"quantization_type": "adaquant"}
    with pytest.raises(ValueError, match=r"wire.weights='int3'; use one of \['float16'"):
        configured_job(FCL, sets=["wire.weights=int3"])
    with pytest.raises(ValueError, match="wire key 'bank' is unknown"):
        configured_job(FCL, sets=["wire.bank=float16"])


def test_the_wire_switch_needs_the_meters(tmp_path):
    job = tmp_path / "bare"
    os.makedirs(job / "app" / "config")
    (job / "meta.json").write_text(json.dumps({"name": "bare"}))
    for part in ("server", "client"):
        (job / "app" / "config" / f"config_fed_{part}.json").write_text(json.dumps({"format_version": 2}))
    with pytest.raises(ValueError, match="finds the exchanged tasks by the server's communication meters"):
        configured_job(str(job), sets=["wire.weights=float16"])


def test_missing_sites_lowers_every_round_workflows_min_clients_and_refuses_where_every_site_is_needed(tmp_path):
    """Issue 46: a round may go on without up to K sites (a dead, partitioned or frozen one), as a switch; the paper
    settings keep every site; FedDRA's vocabulary, the surgical class registration and Fed-BEiT's k-means need
    every site and say so."""
    files = configured_job(FCL, n_sites=3, sets=["rounds.missing_sites=1"])
    assert files["meta.json"]["min_clients"] == 2
    sag = [c for c in files["app/config/config_fed_server.json"]["workflows"] if "num_rounds" in c["args"]]
    assert [c["args"]["min_clients"] for c in sag] == [2]
    assert configured_job(FCL, n_sites=3)["meta.json"]["min_clients"] == 3  # K = 0: every site
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"jobs": {"*": {"rounds": {"missing_sites": 2}}}}))
    assert configured_job(FCL, profile=str(prof), n_sites=5)["meta.json"]["min_clients"] == 3
    for job, name in (("feddra_retina", "FederatedVocabulary"), ("surgical_cxr", "ClassRegistration"),
                      ("sslfl_beit_retina", "FederatedKMeans")):
        with pytest.raises(ValueError, match=f"{job}: {name} needs every site"):
            configured_job(os.path.join(REPO_ROOT, "jobs", job), sets=["rounds.missing_sites=1"])
    assert configured_job(os.path.join(REPO_ROOT, "jobs", "feddra_retina"), sets=["rounds.missing_sites=0"])
    for expr, match in (("rounds.missing_sites=3", r"min_clients=3 with rounds.missing_sites=3 leaves no site"),
                        ("rounds.missing_sites=-1", "missing_sites=-1"), ("rounds.missing_sites=true", "missing_sites"),
                        ("rounds.tolerate=1", "rounds.tolerate is unknown; settable: rounds.missing_sites")):
        with pytest.raises(ValueError, match=match):
            configured_job(FCL, n_sites=3, sets=[expr])


def test_runner_settings_go_to_the_server_config_profile_first_then_set(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"jobs": {"*": {"runner": {"task_request_interval": 0.5, "heart_beat_timeout": 90}}}}))
    server = configured_job(FCL, profile=str(prof), sets=["runner.task_request_interval=0.2"])[
        "app/config/config_fed_server.json"]
    assert server["server"] == {"task_request_interval": 0.2, "heart_beat_timeout": 90}
    assert "server" not in configured_job(FCL)["app/config/config_fed_server.json"]  # FLARE's defaults otherwise
    for expr, match in (("runner.task_request_interval=0", r"runner.task_request_interval=0; use a positive number"),
                        ("runner.task_request_interval=fast", "runner.task_request_interval='fast'"),
                        ("runner.task_request_interval=true", "runner.task_request_interval=True"),
                        ("runner.task_interval=1", "runner key 'task_interval' is unknown; settable: task_request")):
        with pytest.raises(ValueError, match=match):
            configured_job(FCL, sets=[expr])


def test_the_quick_profile_shortens_the_task_request_interval_of_every_job():
    for name in sorted(os.listdir(os.path.join(REPO_ROOT, "jobs"))):
        if os.path.isfile(os.path.join(REPO_ROOT, "jobs", name, "meta.json")):
            files = configured_job(os.path.join(REPO_ROOT, "jobs", name), profile="quick")
            servers = [v for k, v in files.items() if k.endswith("config_fed_server.json")]
            assert servers and all(s["server"]["task_request_interval"] == 0.5 for s in servers), name


def test_a_declared_type_is_named_as_the_json_it_takes():
    """The settings dataclasses declare sequences as Sequence[int]; a user writing JSON reads 'list[int]'."""
    import collections.abc
    import typing

    from fedssl.ops.jobs import _json_type

    assert _json_type(collections.abc.Sequence[int]) == "list[int]"
    assert _json_type(typing.Optional[tuple[float, ...]]) == "list[float, ...] | null"
    assert _json_type(typing.Mapping[str, int]) == "object"
    assert (_json_type(int), _json_type(list)) == ("int", "list")
