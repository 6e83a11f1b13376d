import json
import os

import yaml

from fedssl.ops.deploy import configure_site, free_port, isolate_server_storage, write_project
from fedssl.ops.policy import class_allow_list


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
    configure_site(str(kit), "site-2", "/data/acdc/{site}")
    res = json.loads((kit / "local" / "resources.json").read_text())
    assert res["components"] == [{"id": "x"}]  # the kit's defaults are kept
    assert "a.b" in res["class_allow_list"] and all(p in res["class_allow_list"] for p in class_allow_list()[-2:])
    assert json.loads((kit / "local" / "fedssl_site.json").read_text()) == {"data_root": "/data/acdc/site-2"}
    privacy = json.loads((kit / "local" / "privacy.json").read_text())
    assert privacy["default_scope"] == "public"
    assert {s["name"] for s in privacy["scopes"]} == {"public", "perturbed_features"}


def test_server_storage_moves_into_the_workspace(tmp_path):
    res = {"snapshot_persistor": {"args": {"storage": {"args": {"root_dir": "/tmp/nvflare/snapshot-storage"}}}},
           "components": [{"id": "job_manager", "args": {"uri_root": "/tmp/nvflare/jobs-storage"}}]}
    path = tmp_path / "resources.json"
    path.write_text(json.dumps(res))
    isolate_server_storage(str(path), str(tmp_path / "st"))
    out = json.loads(path.read_text())
    assert out["components"][0]["args"]["uri_root"] == os.path.join(str(tmp_path / "st"), "jobs-storage")
    assert out["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"].startswith(str(tmp_path / "st"))
