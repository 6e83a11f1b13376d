"""What a job may run on a site: exact component classes on the allow-list, checked the way FLARE checks them,
and an authorisation policy where no role may bring its own code (BYOC)."""

import copy
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil

import pytest
import torch
import yaml
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.apis.workspace import Workspace
from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer
from nvflare.fuel.hci.reg import CommandModule
from nvflare.fuel.sec.authz import AuthzContext, Person
from nvflare.fuel.utils.class_loader import load_class
from nvflare.security.security import COMMAND_CATEGORIES, FLAuthorizer

from fedssl.ops.jobs import REPO_ROOT, job_configs
from fedssl.ops.policy import (COMPONENT_CLASSES, RIGHTS, component_configs, refusals, write_allow_list,
                               write_authorization, write_site_local)

JOBS_DIR = os.path.join(REPO_ROOT, "jobs")
JOBS = sorted(d for d in os.listdir(JOBS_DIR) if os.path.isfile(os.path.join(JOBS_DIR, d, "meta.json")))
#: callables of the package that are not components: a job naming one must be refused
NOT_COMPONENTS = ("fedssl.ops.jobs.build_job", "fedssl.cli.main", "fedssl.core.safe_load.safe_load",
                  "fedssl.ops.deploy.deploy_and_run")


class _Site:
    """A site as FLARE's authoriser sees it: where its resources.json is."""

    def __init__(self, resources_json):
        self.resources_json = resources_json

    def get_resources_file_path(self):
        return self.resources_json


@pytest.fixture
def site(tmp_path):
    """A provisioned kit's local/ folder (FLARE's default allow-list), configured by fedssl.ops.policy."""
    local = tmp_path / "local"
    local.mkdir()
    (local / "resources.json.default").write_text(json.dumps({"format_version": 2,
                                                              "class_allow_list": list(DEFAULT_CLASS_ALLOW_LIST)}))
    return _Site(write_allow_list(str(local)))


def _allowed(site, path: str) -> bool:
    try:
        ComponentPathAuthorizer().authorize_component_config({"id": "c", "path": path}, workspace=site)
        return True
    except UnsafeComponentError:
        return False


# ---- the list: every job component on it, nothing else than component classes ------------------------------


@pytest.mark.parametrize("job", JOBS)
def test_every_component_of_every_job_is_on_the_list(job):
    files = {os.path.basename(p): cfg for p, cfg in job_configs(os.path.join(JOBS_DIR, job))}
    assert {"config_fed_client.json", "config_fed_server.json"} <= set(files)
    for fname, cfg in files.items():
        paths = [c["path"] for _, c in component_configs(cfg)]
        assert paths, f"{job}/{fname}: no component found"
        missing = sorted(set(paths) - set(COMPONENT_CLASSES))
        assert not missing, f"{job}/{fname} names classes the sites do not allow: {missing}"


@pytest.mark.parametrize("entry", COMPONENT_CLASSES)
def test_every_entry_is_a_component_class(entry):
    cls = load_class(entry)  # FLARE's own loader, as a site builds it
    assert inspect.isclass(cls), f"{entry} is not a class"
    assert issubclass(cls, (FLComponent, torch.nn.Module)), f"{entry} is neither an FLComponent nor an nn.Module"


def test_the_list_names_each_class_once_and_no_package():
    assert len(set(COMPONENT_CLASSES)) == len(COMPONENT_CLASSES)
    assert not [e for e in COMPONENT_CLASSES if e.endswith(".") or "*" in e]


@pytest.mark.parametrize("entry", COMPONENT_CLASSES)
def test_an_entry_is_no_usable_prefix(entry, site):
    """FLARE allows ``entry`` and ``entry.<anything>`` (prefix match on whole dotted parts): the first is the
    class; the second cannot be loaded, because ``entry`` is not a module.  ``entryX`` is not allowed at all."""
    assert _allowed(site, entry)
    assert not _allowed(site, entry + "X")
    assert load_class(entry).__module__ == entry.rpartition(".")[0]  # the entry is module + class name, exactly
    with pytest.raises(ImportError):
        importlib.util.find_spec(entry)  # the class's module is no package: nothing lives below the class
    with pytest.raises(TypeError, match="Can't load class"):
        load_class(entry + ".mro")


# ---- a site refuses a job that names anything else ----------------------------------------------------------


@pytest.mark.parametrize("path", NOT_COMPONENTS)
def test_site_refuses_a_function_of_the_package(path, site):
    with pytest.raises(UnsafeComponentError, match=f"Component '{path}' at config path .* is not in allow_list"):
        ComponentPathAuthorizer().authorize_component_config({"id": "evil", "path": path, "args": {}}, workspace=site)


def test_site_allows_every_class_of_the_list(site):
    assert all(_allowed(site, e) for e in COMPONENT_CLASSES)


def _job_with(tmp_path, server_config: dict) -> str:
    job = tmp_path / "job"
    (job / "app" / "config").mkdir(parents=True)
    (job / "meta.json").write_text(json.dumps({"name": "job", "deploy_map": {"app": ["@ALL"]}, "min_clients": 1}))
    (job / "app" / "config" / "config_fed_server.json").write_text(json.dumps(server_config))
    (job / "app" / "config" / "config_fed_client.json").write_text(json.dumps({"format_version": 2, "executors": []}))
    return str(job)


def test_refusals_name_the_class_file_and_component(tmp_path, site):
    evil = {"id": "evil", "path": "fedssl.ops.jobs.build_job", "args": {"job_dir": "/x", "out_dir": "/y"}}
    nested = {"id": "persistor", "path": "fedssl.flare.weights_only_persistor.WeightsOnlyPersistor",
              "args": {"model": {"path": "fedssl.cli.main", "args": {}}}}
    job = _job_with(tmp_path, {"format_version": 2, "components": [evil, nested]})
    assert refusals(job, site.resources_json) == [
        "site refused the job: class fedssl.ops.jobs.build_job is not allowed "
        "(app/config/config_fed_server.json, components, id 'evil')",
        "site refused the job: class fedssl.cli.main is not allowed "
        "(app/config/config_fed_server.json, components.args.model, id None)",
    ]


def test_refusals_follow_flare_on_plain_dicts_but_not_in_the_components_list(tmp_path, site):
    """``"config_type": "dict"`` makes FLARE pass a nested dict on unbuilt, but not an entry of ``components``."""
    plain = {"id": "x", "path": "fedssl.flare.weights_only_persistor.WeightsOnlyPersistor",
             "args": {"meta": {"path": "not.a.Class", "config_type": "dict"}}}
    hidden = {"id": "evil", "path": "fedssl.ops.jobs.build_job", "config_type": "dict"}
    assert refusals(_job_with(tmp_path / "a", {"components": [plain]}), site.resources_json) == []
    assert refusals(_job_with(tmp_path / "b", {"components": [hidden]}), site.resources_json) == [
        "site refused the job: class fedssl.ops.jobs.build_job is not allowed "
        "(app/config/config_fed_server.json, components, id 'evil')"]


def test_a_job_with_custom_code_is_refused(tmp_path, site):
    """FLARE's authoriser skips the allow-list for a BYOC job (and the simulator runs it): refuse it outright."""
    job = _job_with(tmp_path, {"components": []})
    assert refusals(job, site.resources_json) == []
    os.makedirs(os.path.join(job, "app", "custom"))
    assert refusals(job, site.resources_json) == [
        "site refused the job: it carries custom code (app/custom); no role may submit BYOC jobs"]


@pytest.mark.parametrize("job", JOBS)
def test_no_job_of_the_bundle_is_refused(job, site):
    assert refusals(os.path.join(JOBS_DIR, job), site.resources_json) == []


# ---- writing the allow-list ---------------------------------------------------------------------------------


def test_write_allow_list_keeps_exact_classes_and_drops_whatever_allows_more(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    kit = ["fedssl.", "*", "nvflare.app_common.", "fedssl.ops", "os.path", "fedssl.ops.jobs.build_job",
           "hospital.tools.Exporter", DEFAULT_CLASS_ALLOW_LIST[0]]
    (local / "resources.json").write_text(json.dumps({"format_version": 2, "components": [{"id": "x"}],
                                                      "class_allow_list": kit, "class_list_enforcement_mode": "warn"}))
    res = json.loads(open(write_allow_list(str(local))).read())
    allow = res["class_allow_list"]
    assert res["components"] == [{"id": "x"}] and res["class_list_enforcement_mode"] == "enforce"
    for gone in ("fedssl.", "*", "nvflare.app_common.", "fedssl.ops", "os.path", "fedssl.ops.jobs.build_job"):
        assert gone not in allow
    assert "hospital.tools.Exporter" in allow and DEFAULT_CLASS_ALLOW_LIST[0] in allow
    assert set(COMPONENT_CLASSES) <= set(allow) and len(set(allow)) == len(allow)
    assert json.loads(open(write_allow_list(str(local))).read()) == res  # rerunning changes nothing


# ---- authorisation: no role may bring its own code ----------------------------------------------------------


def _provisioned_authz() -> dict:
    """The policy ``nvflare provision`` writes into every kit (authorization.json.default)."""
    import nvflare.lighter

    with open(os.path.join(os.path.dirname(nvflare.lighter.__file__), "templates", "master_template.yml")) as f:
        return json.loads(yaml.safe_load(f)["default_authz"])


def _may(policy: dict, role: str, right: str, org: str = "hospital_a") -> bool:
    """FLARE's own evaluation: may a ``role`` user of ``org`` exercise ``right`` on a site of ``org``?"""
    user = Person("someone@x.org", org, role)
    return FLAuthorizer(org, policy).authorize(AuthzContext(right=right, user=user, submitter=user))[0]


def _flare_rights() -> set[str]:
    """Every right FLARE 2.9 checks: command categories, BYOC, predeployed Flower, and the name of every server
    command outside a category that asks for authorisation."""
    import nvflare.private.fed.server as server

    rights = set(COMMAND_CATEGORIES.values()) | {"byoc", "server-predeployed-flwr"}
    for info in pkgutil.iter_modules(server.__path__):
        module = importlib.import_module(f"{server.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, CommandModule) and cls.__module__ == module.__name__ and not inspect.isabstract(cls):
                rights |= {s.name for s in cls().get_spec().cmd_specs
                           if s.authz_func and s.name not in COMMAND_CATEGORIES}
    return rights


@pytest.fixture
def kit(tmp_path):
    (tmp_path / "startup").mkdir()
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "authorization.json.default").write_text(json.dumps(_provisioned_authz()))
    return tmp_path


def test_provisioned_policy_lets_lead_and_project_admin_bring_code():
    """The premise: FLARE's provisioned default grants BYOC (lead explicitly, project_admin through "any")."""
    default = _provisioned_authz()
    assert _may(default, "lead", "byoc") and _may(default, "project_admin", "byoc")


def test_written_authorization_has_byoc_off_for_every_role_and_flare_reads_it(kit):
    path = write_authorization(str(kit / "local"))
    assert Workspace(str(kit)).get_authorization_file_path() == path  # preferred over authorization.json.default
    policy = json.loads(open(path).read())
    FLAuthorizer("hospital_a", policy)  # FLARE's parser accepts it (raises SyntaxError otherwise)
    assert set(policy["permissions"]) == set(_provisioned_authz()["permissions"])
    for role, rights in policy["permissions"].items():
        assert rights["byoc"] == "none", role
        assert not _may(policy, role, "byoc"), role


def test_every_other_right_is_as_provisioned(kit):
    default = _provisioned_authz()
    policy = json.loads(open(write_authorization(str(kit / "local"))).read())
    for role in default["permissions"]:
        for right in _flare_rights() - {"byoc"}:
            for org in ("hospital_a", "hospital_b"):
                assert _may(policy, role, right, org) == _may(default, role, right, org), (role, right, org)


def test_rights_cover_every_right_flare_checks():
    """A role given as one expression ("any") is expanded over RIGHTS: it must hold every right FLARE asks for."""
    assert _flare_rights() <= set(RIGHTS), sorted(_flare_rights() - set(RIGHTS))


def test_authorization_is_rewritten_from_its_own_output_and_from_nothing(tmp_path, kit):
    first = json.loads(open(write_authorization(str(kit / "local"))).read())
    assert json.loads(open(write_authorization(str(kit / "local"))).read()) == first
    bare = json.loads(open(write_authorization(str(tmp_path / "bare"))).read())  # no kit policy: FLARE's default
    assert bare == first


def test_write_site_local_writes_both_files(kit):
    before = copy.deepcopy(_provisioned_authz())
    resources = write_site_local(str(kit / "local"))
    assert os.path.basename(resources) == "resources.json"
    assert json.loads((kit / "local" / "authorization.json").read_text())["permissions"]["lead"]["byoc"] == "none"
    assert json.loads((kit / "local" / "authorization.json.default").read_text()) == before  # the kit's file kept


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"class_allow_list": "fedssl."}'])
def test_a_broken_kit_file_is_one_error_naming_it(tmp_path, content):
    (tmp_path / "resources.json").write_text(content)
    with pytest.raises(ValueError, match=f"{tmp_path / 'resources.json'}: .*fix or remove it"):
        write_allow_list(str(tmp_path))
    assert (tmp_path / "resources.json").read_text() == content  # nothing lost
