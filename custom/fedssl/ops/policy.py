"""Site-local FLARE policy: which component classes a job may name, and that no role may bring its own code.

Job folders carry no ``custom/`` code (the bundle is pip-installed on every site), so a site builds a job's
components from the classes it already has, and FLARE checks each component path against the site's
``local/resources.json`` ``class_allow_list`` before it builds it (``ComponentPathAuthorizer``, for the
server and every site, the simulator included).  That list used to carry the prefix ``fedssl.``, which let a
job name *any* callable of the package -- ``fedssl.ops.jobs.build_job`` with ``out_dir`` set deleted a folder
on the server.  It now names exact classes: :data:`COMPONENT_CLASSES`.

How FLARE 2.9 matches an entry (``ComponentPathAuthorizer._path_matches_prefix``): an entry ending in ``.``
is a package prefix; any other entry matches the path itself *and every path below it* (``entry + "."``);
there are no regex entries.  So ``fedssl.flare.fcl_executor.FCLExecutor`` does not allow
``...FCLExecutorX`` (a ``.`` must follow), and what it does allow below it, ``...FCLExecutor.attr``, cannot be
loaded: FLARE's ``load_class`` imports everything before the last dot as a *module*, and a class is not one.
The tests check both for every entry, with FLARE's own matcher and loader.  An entry that names a module
(``fedssl.ops``) would be a package prefix in disguise: :func:`write_allow_list` drops those from a kit.

BYOC: a job with custom code skips the allow-list altogether (FLARE's authoriser returns early for it), and
FLARE's provisioned ``authorization.json.default`` gives the ``lead`` role (and ``project_admin``, via
``"any"``) the ``byoc`` right.  The bundle needs no custom code in jobs, so :func:`write_authorization` writes
``local/authorization.json`` (FLARE reads it in preference to the ``.default``: ``Workspace
.get_authorization_file_path``) with ``byoc`` ``"none"`` for every role.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Iterator

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.security.security import COMMAND_CATEGORIES

from fedssl.ops.jobs import job_configs

logger = logging.getLogger(__name__)

#: every class a job config of this bundle names -- the one list a site allows besides FLARE's defaults
COMPONENT_CLASSES = (
    # executors (client)
    "fedssl.flare.byol_executor.BYOLExecutor",
    "fedssl.flare.classifier_executor.ClassifierExecutor",
    "fedssl.flare.fcl_executor.FCLExecutor",
    "fedssl.flare.fedclf_executor.FedCLFExecutor",
    "fedssl.flare.feddra_executor.FedDRAExecutor",
    "fedssl.flare.resnet_classifier_executor.ResNetClassifierExecutor",
    "fedssl.flare.mim_executor.MIMExecutor",
    "fedssl.flare.multilabel_executor.MultiLabelExecutor",
    "fedssl.flare.segmentation_executor.SegmentationExecutor",
    "fedssl.flare.seg3d_executor.Seg3DExecutor",
    # filters (client and server); FeatureBankPerturbation is a site's privacy filter, also nameable by a job
    "fedssl.flare.backbone_exclusion.BackboneBNExclusion",
    "fedssl.flare.communication_meter.CommunicationMeter",
    "fedssl.flare.quantization.Quantizer",
    "fedssl.flare.quantization.Dequantizer",
    "fedssl.flare.quantization.BankPrecision",
    "fedssl.flare.dro_weight_filter.DROWeightFilter",
    "fedssl.flare.feature_bank_perturbation.FeatureBankPerturbation",
    "fedssl.flare.feature_bank_shuttle.FeatureBankShuttle",
    "fedssl.flare.head_slicer.HeadSlicer",
    "fedssl.flare.partial_exclusion.PartialModelExclusion",
    # aggregators, collectors, persistors, shareable generators, widgets (server)
    "fedssl.flare.fedavg_aggregator.FedAvgAggregator",
    "fedssl.flare.surgical_aggregator.SurgicalAggregator",
    # FLARE's PTFileModelPersistor with weights_only loading a job cannot switch off (FLARE's class is not listed)
    "fedssl.flare.weights_only_persistor.WeightsOnlyPersistor",
    "fedssl.flare.feature_bank_collector.FeatureBankCollector",
    "fedssl.flare.surgical_persistor.SurgicalModelPersistor",
    "fedssl.flare.merging_shareable_generator.MergingShareableGenerator",
    "fedssl.flare.run_summary.RunSummary",
    "fedssl.flare.round_checkpoint.RoundCheckpoint",
    # controllers (server)
    "fedssl.flare.fclopt_controller.FCLOptController",
    "fedssl.flare.feddra_controller.FedDRAController",
    "fedssl.flare.federated_vocabulary.FederatedVocabulary",
    "fedssl.flare.federated_kmeans.FederatedKMeans",
    "fedssl.flare.final_evaluation.FinalEvaluation",
    "fedssl.flare.surgical_evaluation.SurgicalEvaluation",
    "fedssl.flare.surgical_registration.ClassRegistration",
    # models the server configs name for the persistors
    "fedssl.models.densenet.MultiLabelDenseNet",
    "fedssl.models.resnet.PretrainingResNet",
    "fedssl.models.resnet.ResNetClassifier",
    "fedssl.models.unet.BYOLUNetEncoder",
    "fedssl.models.unet.MoCoUNetEncoder",
    "fedssl.models.unet.UNet2D",
    "fedssl.models.dynunet3d.DynUNet3D",
    "fedssl.models.vit.BEiTViT",
    "fedssl.models.vit.MAEViT",
    "fedssl.models.vit_classifier.FineTuneViT",
    "fedssl.models.vlp.VisionLanguageModel",
    # FLARE components the jobs use (in FLARE 2.9's default list too; named so the jobs keep working
    # should a FLARE release drop them there)
    "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather",
    "nvflare.app_common.widgets.intime_model_selector.IntimeModelSelector",
    "nvflare.app_opt.tracking.tb.tb_writer.TBWriter",
    "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
    "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
)

ALLOW_LIST_KEY = "class_allow_list"
ENFORCEMENT_KEY = "class_list_enforcement_mode"
#: what a refused job is reported as, by the simulator run and by the deployment
REFUSED = "site refused the job"


def class_allow_list() -> list[str]:
    """FLARE's default list (FLARE's own vetted components, e.g. the JobLogStreamer a provisioned site injects
    into every job) plus :data:`COMPONENT_CLASSES`: exact classes only."""
    return list(DEFAULT_CLASS_ALLOW_LIST) + [p for p in COMPONENT_CLASSES if p not in DEFAULT_CLASS_ALLOW_LIST]


def _names_a_module(entry: str) -> bool:
    """Whether ``entry`` is a module or package (so that FLARE would allow everything below it)."""
    try:
        return importlib.util.find_spec(entry) is not None
    except (ImportError, ValueError):  # parent is no package, or cannot be imported: nothing below it loads
        return False


def _keeps(entry: object) -> bool:
    """A kit's own entry stays if it is an exact class path: not ``*``, not a package prefix (``x.``), not a
    module, and not a ``fedssl`` path (the bundle's classes are exactly :data:`COMPONENT_CLASSES`)."""
    if not isinstance(entry, str) or entry == "*" or entry.endswith(".") or entry.startswith("fedssl."):
        return False
    return entry in DEFAULT_CLASS_ALLOW_LIST or not _names_a_module(entry)


def _read_json(local_dir: str, name: str, list_key: str | None = None) -> dict:
    """``local_dir/name``, else the kit's ``name.default`` (FLARE reads ``name`` *instead* of it), else {}; a
    file that is not a JSON object (or whose ``list_key`` is not a list) is an error naming it."""
    for source in (os.path.join(local_dir, name), os.path.join(local_dir, name + ".default")):
        if os.path.isfile(source):
            try:
                with open(source) as f:
                    content = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{source}: not valid JSON ({e}); fix or remove it, then run this again") from e
            if not isinstance(content, dict) or not isinstance(content.get(list_key, []), list):
                raise ValueError(f"{source}: expected a JSON object" + (f" whose {list_key!r} is a list" if list_key
                                 else "") + "; fix or remove it, then run this again")
            return content
    return {}


def _write_json(path: str, data: dict) -> str:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path


def write_allow_list(local_dir: str) -> str:
    """Write (or update) ``local_dir/resources.json``: the kit's settings, its exact-class allow-list entries,
    :func:`class_allow_list`, enforcement ``enforce``; returns its path.  Entries that would allow more than
    one class (``*``, ``fedssl.``, a module) are dropped, and logged."""
    os.makedirs(local_dir, exist_ok=True)
    resources = _read_json(local_dir, "resources.json", ALLOW_LIST_KEY)
    kit = resources.get(ALLOW_LIST_KEY) or list(DEFAULT_CLASS_ALLOW_LIST)
    dropped = [e for e in kit if not _keeps(e) and e not in COMPONENT_CLASSES]
    if dropped:
        logger.warning("%s: dropped allow-list entries that are not exact classes: %s", local_dir, dropped)
    allow = [e for e in kit if e not in dropped]
    resources[ALLOW_LIST_KEY] = allow + [p for p in class_allow_list() if p not in allow]
    resources[ENFORCEMENT_KEY] = "enforce"  # "warn" would build an unlisted class after a log line
    return _write_json(os.path.join(local_dir, "resources.json"), resources)


#: every right FLARE 2.9 authorises: the command categories, and the commands outside a category that ask
#: for authorisation (their name is the right) -- a test derives this set from FLARE's command modules
RIGHTS = tuple(sorted(set(COMMAND_CATEGORIES.values()) | {
    "submit_job", "clone_job", "list_job", "get_job_log", "download_job_components", "app_command",
    "report_version", "dead", "admin_check_status", "register_study", "remove_study", "show_study",
    "list_studies", "add_study_site", "remove_study_site", "add_study_user", "remove_study_user",
    "server-predeployed-flwr", "byoc",
}))


def _flare_default_authz() -> dict:
    """The policy ``nvflare provision`` puts in every kit (``default_authz`` of FLARE's master template)."""
    import nvflare.lighter
    import yaml

    template = os.path.join(os.path.dirname(nvflare.lighter.__file__), "templates", "master_template.yml")
    with open(template) as f:
        return json.loads(yaml.safe_load(f)["default_authz"])


def byoc_off(policy: dict) -> dict:
    """``policy`` with the ``byoc`` right ``"none"`` for every role; a role given as one expression for all
    rights (``"project_admin": "any"``) becomes that expression per right of :data:`RIGHTS`, byoc excepted."""
    permissions = {}
    for role, rights in policy.get("permissions", {}).items():
        if not isinstance(rights, dict):
            rights = {right: rights for right in RIGHTS}
        permissions[role] = {**rights, "byoc": "none"}
    return {**policy, "permissions": permissions}


def write_authorization(local_dir: str) -> str:
    """Write ``local_dir/authorization.json``: the kit's policy (``authorization.json``, else its ``.default``,
    else FLARE's provisioned default) with BYOC off for every role; returns its path."""
    os.makedirs(local_dir, exist_ok=True)
    policy = _read_json(local_dir, "authorization.json") or _flare_default_authz()
    return _write_json(os.path.join(local_dir, "authorization.json"), byoc_off(policy))


def write_site_local(local_dir: str) -> str:
    """A site's whole policy: ``resources.json`` (allow-list) and ``authorization.json`` (no BYOC) in
    ``local_dir``; returns the path of ``resources.json``."""
    write_authorization(local_dir)
    return write_allow_list(local_dir)


def component_configs(config: object, where: str = "") -> Iterator[tuple[str, dict]]:
    """(location, dict) of every dict in a FLARE config that a site would build as a component: it has
    ``path`` or ``class_path`` (or ``name`` with ``id`` / ``args``), at any depth (nested ``args`` too), unless
    it is marked ``"config_type": "dict"`` outside a ``components`` list (FLARE passes those on unbuilt)."""
    if isinstance(config, dict):
        named = "path" in config or "class_path" in config or ("name" in config and ({"id", "args"} & set(config)))
        in_components = where.endswith("components")
        if named and (config.get("config_type", "component") != "dict" or in_components):
            yield where, config
        for k, v in config.items():
            yield from component_configs(v, f"{where}.{k}" if where else k)
    elif isinstance(config, list):
        for v in config:
            yield from component_configs(v, where)


class _SiteResources:
    """The one thing FLARE's authoriser asks of a workspace: where the site's resources.json is."""

    def __init__(self, resources_json: str):
        self.resources_json = resources_json

    def get_resources_file_path(self) -> str:
        return self.resources_json


def byoc_parts(job_dir: str) -> list[str]:
    """What makes a job BYOC for FLARE: an app with a ``custom/`` folder, or ``"byoc"`` in its meta.json."""
    parts = [os.path.join(app, "custom") for app in sorted(os.listdir(job_dir))
             if os.path.isdir(os.path.join(job_dir, app, "custom"))]
    meta = os.path.join(job_dir, "meta.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            if json.load(f).get("byoc"):
                parts.append("meta.json byoc")
    return parts


def refusals(job_dir: str, resources_json: str) -> list[str]:
    """Why a site with ``resources_json`` refuses the job, one line each (empty: it runs it).  Each component is
    checked by FLARE's own authoriser; a job with custom code is refused outright, since it would skip it."""
    out = [f"{REFUSED}: it carries custom code ({part}); no role may submit BYOC jobs"
           for part in byoc_parts(job_dir)]
    authorizer = ComponentPathAuthorizer()
    site = _SiteResources(resources_json)
    for path, config in job_configs(job_dir):
        fname = os.path.relpath(path, job_dir)
        for where, comp in component_configs(config):
            try:
                authorizer.authorize_component_config(comp, workspace=site)
            except UnsafeComponentError as e:
                cls = comp.get("path", comp.get("class_path", comp.get("name")))
                what = f"class {cls} is not allowed" if "not in allow_list" in str(e) else str(e)
                out.append(f"{REFUSED}: {what} ({fname}, {where}, id {comp.get('id')!r})")
    return out
