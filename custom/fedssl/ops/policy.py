"""Site-local FLARE policy that authorises this bundle's classes (non-BYOC jobs).

Job folders carry no ``custom/`` code (the bundle is pip-installed on every site), so FLARE checks each
component path against the site's ``local/resources.json`` ``class_allow_list``.  That list *replaces*
FLARE's default list, so we keep the defaults and add the bundle's package prefix and the FLARE PyTorch
components the jobs use.
"""

from __future__ import annotations

import json
import os

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

BUNDLE_ALLOW = (
    "fedssl.",
    "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
    # training curves (every job): client TBWriter -> ConvertToFedEvent -> server TBAnalyticsReceiver; in
    # FLARE 2.9's default list too, named here so the jobs keep working should a FLARE release drop them there
    "nvflare.app_opt.tracking.tb.tb_writer.TBWriter",
    "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
    "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
)


def class_allow_list() -> list[str]:
    return list(DEFAULT_CLASS_ALLOW_LIST) + [p for p in BUNDLE_ALLOW if p not in DEFAULT_CLASS_ALLOW_LIST]


def write_site_local(local_dir: str) -> str:
    """Write (or update) ``local_dir/resources.json`` so the bundle's components are allowed; returns its path."""
    os.makedirs(local_dir, exist_ok=True)
    path = os.path.join(local_dir, "resources.json")
    resources: dict = {}
    # a provisioned kit ships resources.json.default (job manager, storage, ...): FLARE reads
    # resources.json *instead* of it, so start from it and only extend the allow-list
    for source in (path, path + ".default"):
        if os.path.isfile(source):
            with open(source) as f:
                resources = json.load(f)
            break
    allow = list(resources.get("class_allow_list") or DEFAULT_CLASS_ALLOW_LIST)
    allow += [p for p in class_allow_list() if p not in allow]
    resources["class_allow_list"] = allow
    with open(path, "w") as f:
        json.dump(resources, f, indent=2)
    return path
