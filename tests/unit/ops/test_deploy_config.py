import json
import os

import pytest
import yaml

from fedssl.ops import deploy
from fedssl.ops.deploy import (LoopbackDeployment, configure_server, configure_site, free_port,
                               isolate_server_storage, write_project)
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.policy import COMPONENT_CLASSES

#: a provisioned kit's authorization.json.default, as FLARE 2.9's master template writes it (two roles)
KIT_AUTHZ = {"format_version": "1.0", "permissions": {
    "project_admin": "any",
    "lead": {"submit_job": "any", "clone_job": "n:submitter", "manage_job": "n:submitter",
             "download_job": "n:submitter", "view": "any", "operate": "o:site", "shell_commands": "o:site",
             "byoc": "any", "server-predeployed-flwr": "none"}}}


def _no_byoc(local) -> None:
    authz = json.loads((local / "authorization.json").read_text())
    assert set(authz["permissions"]) == {"project_admin", "lead"}
    assert {role: rights["byoc"] for role, rights in authz["permissions"].items()} == {"project_admin": "none",
                                                                                      "lead": "none"}


def test_project_has_n_sites_admins_and_the_port(tmp_path):
    port = free_port()
    project = write_project(str(tmp_path / "p.yml"), 3, port)
    with open(tmp_path / "p.yml") as f:
        assert yaml.safe_load(f) == project
    clients = [p["name"] for p in project["participants"] if p["type"] == "client"]
    server = [p for p in project["participants"] if p["type"] == "server"][0]
    assert clients == ["site-1", "site-2", "site-3"] and server["fed_learn_port"] == port
    assert {p["role"] for p in project["participants"] if p["type"] == "admin"} >= {"project_admin", "lead"}


def test_site_configuration(tmp_path):
    kit = tmp_path / "site-2"
    (kit / "local").mkdir(parents=True)
    (kit / "local" / "resources.json.default").write_text(json.dumps({"format_version": 2, "class_allow_list": ["a.b"],
                                                                     "components": [{"id": "x"}]}))
    (kit / "local" / "authorization.json.default").write_text(json.dumps(KIT_AUTHZ))
    configure_site(str(kit), "site-2", "/data/acdc/{site}")
    res = json.loads((kit / "local" / "resources.json").read_text())
    assert res["components"] == [{"id": "x"}]  # the kit's defaults are kept
    allow = res["class_allow_list"]
    assert "a.b" in allow and set(COMPONENT_CLASSES) <= set(allow) and not [e for e in allow if e.endswith(".")]
    _no_byoc(kit / "local")
    assert json.loads((kit / "local" / "fedssl_site.json").read_text()) == {"data_root": "/data/acdc/site-2"}
    privacy = json.loads((kit / "local" / "privacy.json").read_text())
    assert privacy == json.loads(open(deploy.PRIVACY_JSON).read())  # the bundle's scopes (app_config/privacy.json)
    assert privacy["default_scope"] in {s["name"] for s in privacy["scopes"]}


def test_server_configuration(tmp_path):
    kit = tmp_path / "localhost"
    (kit / "local").mkdir(parents=True)
    res = {"format_version": 2, "snapshot_persistor": {"args": {"storage": {"args": {"root_dir": "/tmp/nvflare/s"}}}},
           "components": [{"id": "job_manager", "args": {"uri_root": "/tmp/nvflare/jobs-storage"}}]}
    (kit / "local" / "resources.json.default").write_text(json.dumps(res))
    (kit / "local" / "authorization.json.default").write_text(json.dumps(KIT_AUTHZ))
    configure_server(str(kit), str(tmp_path / "st"))
    out = json.loads((kit / "local" / "resources.json").read_text())
    assert set(COMPONENT_CLASSES) <= set(out["class_allow_list"]) and "fedssl." not in out["class_allow_list"]
    assert out["components"][0]["args"]["uri_root"] == str(tmp_path / "st" / "jobs-storage")
    _no_byoc(kit / "local")


def test_server_storage_moves_into_the_workspace(tmp_path):
    res = {"snapshot_persistor": {"args": {"storage": {"args": {"root_dir": "/tmp/nvflare/snapshot-storage"}}}},
           "components": [{"id": "job_manager", "args": {"uri_root": "/tmp/nvflare/jobs-storage"}}]}
    path = tmp_path / "resources.json"
    path.write_text(json.dumps(res))
    isolate_server_storage(str(path), str(tmp_path / "st"))
    out = json.loads(path.read_text())
    assert out["components"][0]["args"]["uri_root"] == os.path.join(str(tmp_path / "st"), "jobs-storage")
    assert out["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"].startswith(str(tmp_path / "st"))


#: how a refusal reads in a deployed site's job log and in the server's (FLARE 2.9, real lines shortened)
SITE_LOG = """\
nvflare.fuel.common.excepts.ComponentNotAuthorized: component not authorized: Component 'fedssl.ops.jobs.build_job' \
at config path 'components.#1' is not in allow_list
"""
SERVER_LOG = """\
2026-11-23 15:07:49,412 - runner_process - ERROR - FL server execution exception: ComponentNotAuthorized: Error \
processing ['/ws/prod_00/localhost/88340b5c/app_server/config/config_fed_server.json'] in JSON element {'id': 'evil'}: \
path: components.#1, exception: ComponentNotAuthorized: component not authorized: Component 'fedssl.cli.main' at \
config path 'components.#1' is not in allow_list
"""


def _deployment(tmp_path) -> LoopbackDeployment:
    d = LoopbackDeployment(str(tmp_path / "ws"), n_sites=2, data_root=str(tmp_path))
    d.kits = {name: str(tmp_path / name) for name in ("localhost", "site-1", "site-2", "admin@fedssl.org")}
    return d


def test_refusals_are_read_from_the_sites_job_logs_and_the_servers_downloaded_log(tmp_path):
    d = _deployment(tmp_path)
    (tmp_path / "site-1" / "job1").mkdir(parents=True)
    (tmp_path / "site-1" / "job1" / "log.txt").write_text(SITE_LOG)
    (tmp_path / "site-2" / "job0").mkdir(parents=True)  # another job's log: not this job's refusal
    (tmp_path / "site-2" / "job0" / "log.txt").write_text(SITE_LOG)
    (tmp_path / "result" / "workspace").mkdir(parents=True)
    (tmp_path / "result" / "workspace" / "log.txt").write_text(SERVER_LOG)
    assert d.refusals("job1", str(tmp_path / "result")) == [
        "site refused the job: class fedssl.cli.main is not allowed (at localhost)",
        "site refused the job: class fedssl.ops.jobs.build_job is not allowed (at site-1)"]
    assert d.refusals("job1") == ["site refused the job: class fedssl.ops.jobs.build_job is not allowed (at site-1)"]


def test_a_refused_byoc_job_is_read_from_the_servers_own_log(tmp_path):
    """FLARE refuses a BYOC job before it has a job folder: the line is in the participant's log.txt."""
    d = _deployment(tmp_path)
    (tmp_path / "localhost").mkdir()
    (tmp_path / "localhost" / "log.txt").write_text(
        "2026-11-23 15:15:56,844 - JobRunner - ERROR - [identity=server, run=?] - Failed to run the Job (job0): "
        "RuntimeError: Failed to deploy app 'app': BYOC not permitted\n"
        "2026-11-23 15:15:57,001 - JobRunner - INFO - [identity=server, run=?] - Job (job1) started\n")
    assert d.refusals("job1") == []
    assert d.refusals("job0") == ["site refused the job: it carries custom code (BYOC not permitted) (at localhost)"]


def test_deploy_and_run_names_the_refused_class(tmp_path, monkeypatch):
    refused = ["site refused the job: class fedssl.ops.jobs.build_job is not allowed (at site-1)"]

    def enter(self):
        self.timings["startup_s"] = 0.0
        self.kits["admin@fedssl.org"] = str(tmp_path / "admin")
        return self

    monkeypatch.setattr(LoopbackDeployment, "__enter__", enter)
    monkeypatch.setattr(LoopbackDeployment, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(LoopbackDeployment, "run_job", lambda self, job, timeout_s: {
        "job_id": "j1", "status": "FINISHED:ABNORMAL", "result_dir": "/r/j1", "job_s": 1.0, "refused": refused})
    with pytest.raises(RuntimeError) as e:
        deploy.deploy_and_run(str(tmp_path / "ws"), [os.path.join(REPO_ROOT, "jobs", "fcl_acdc")], n_sites=1,
                              data_root=str(tmp_path), say=lambda msg: None)
    assert str(e.value) == f"job j1 ended FINISHED:ABNORMAL; {refused[0]}; see /r/j1"
