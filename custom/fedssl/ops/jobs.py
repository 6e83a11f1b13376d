"""Job-folder tools: apply a run profile (paper / quick) or single overrides to a copy of a job.

Job folders under ``jobs/`` hold the paper's settings.  A profile (``app_config/profiles/<name>.json``)
names, per job, the component ids whose ``args`` change::

    {"description": "...",
     "jobs": {"fcl_acdc": {"meta":   {"min_clients": 3},
                           "server": {"scatter_and_gather": {"num_rounds": 2}},
                           "client": {"fcl_trainer": {"image_size": 64}}}}}

``"*"`` instead of a job name applies to every job.  Every id and argument must already exist in the
job (a typo is an error, never a silently ignored override).  The result is a normal job folder that
``nvflare simulator`` or ``submit_job`` take as they are.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Any, Iterator

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PROFILES_DIR = os.path.join(REPO_ROOT, "app_config", "profiles")
CONFIG_FILES = {"server": "config_fed_server.json", "client": "config_fed_client.json"}


def _components(config: Any) -> Iterator[dict]:
    """Every dict with an ``id`` and ``args`` anywhere in a FLARE config (components, workflows, executors, filters)."""
    if isinstance(config, dict):
        if "id" in config and "path" in config:
            yield config
        for v in config.values():
            yield from _components(v)
    elif isinstance(config, list):
        for v in config:
            yield from _components(v)


def override_args(config: dict, comp_id: str, args: dict, where: str) -> None:
    matches = [c for c in _components(config) if c["id"] == comp_id]
    if len(matches) != 1:
        ids = sorted({c["id"] for c in _components(config)})
        raise ValueError(f"{where}: component id {comp_id!r} found {len(matches)} times; ids in this config: {ids}")
    comp = matches[0]
    comp.setdefault("args", {})
    for k, v in args.items():
        if k not in comp["args"]:
            raise ValueError(
                f"{where}: component {comp_id!r} has no argument {k!r} in the job config "
                f"(it has {sorted(comp['args'])}); add it to the job first if it is a real argument"
            )
        comp["args"][k] = v


def load_profile(profile: str) -> dict:
    path = profile if os.path.isfile(profile) else os.path.join(PROFILES_DIR, f"{profile}.json")
    if not os.path.isfile(path):
        names = sorted(p[:-5] for p in os.listdir(PROFILES_DIR) if p.endswith(".json")) if os.path.isdir(PROFILES_DIR) else []
        raise ValueError(f"profile {profile!r} not found (looked for {path}); available: {names}")
    with open(path) as f:
        return json.load(f)


#: the part of a profile / ``--set`` that names the job's model shape once (``shape.image_size=64``): it applies
#: to every component of the job, client and server, that takes the argument
SHAPE = "shape"


def profile_overrides(profile: dict, job_name: str) -> dict:
    jobs = profile.get("jobs", {})
    merged: dict = {}
    for key in ("*", job_name):
        for part, comps in jobs.get(key, {}).items():
            target = merged.setdefault(part, {})
            for comp_id, args in comps.items():
                if part in ("meta", SHAPE):
                    target[comp_id] = args
                else:
                    target.setdefault(comp_id, {}).update(args)
    return merged


def apply_shape(configs: dict[str, dict], shape: dict, where: str) -> None:
    """Set each ``shape`` argument in every component (of every config) that has it; an argument no component
    takes is an error (a typo must not pass silently)."""
    for arg, value in shape.items():
        hits = [c for config in configs.values() for c in _components(config) if arg in c.get("args", {})]
        if not hits:
            raise ValueError(f"{where}: shape argument {arg!r} is not an argument of any component of this job; "
                             "shape names model arguments shared by the server and the sites (e.g. image_size)")
        for comp in hits:
            comp["args"][arg] = value


def parse_set(expr: str) -> tuple[str, str, str, Any]:
    """``client.fcl_trainer.lr=0.1`` -> ("client", "fcl_trainer", "lr", 0.1); ``meta.min_clients=3`` and
    ``shape.image_size=64`` (every component of the job that takes image_size) too."""
    if "=" not in expr:
        raise ValueError(f"--set {expr!r}: expected PART.ID.ARG=VALUE, e.g. client.fcl_trainer.lr=0.1")
    lhs, raw = expr.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    parts = lhs.split(".")
    if parts[0] in ("meta", SHAPE) and len(parts) == 2:
        return parts[0], "", parts[1], value
    if len(parts) != 3 or parts[0] not in CONFIG_FILES:
        raise ValueError(f"--set {expr!r}: expected server.ID.ARG=VALUE, client.ID.ARG=VALUE, shape.ARG=VALUE or "
                         "meta.KEY=VALUE")
    return parts[0], parts[1], parts[2], value


def build_job(job_dir: str, out_dir: str, profile: str | None = None, sets: list[str] = (), n_sites: int | None = None) -> str:
    """Copy ``job_dir`` to ``out_dir`` with the profile and ``--set`` overrides applied; returns ``out_dir``.

    ``n_sites`` sets ``min_clients`` in meta.json and of every workflow that has it, over the profile; a
    ``--set`` value takes precedence over both (e.g. tolerate one failed site out of three).  Precedence, lowest
    first: the job, the profile's ``shape``, the profile's component overrides, ``n_sites``, ``--set shape.*``,
    the other ``--set`` overrides.
    """
    job_dir = os.path.abspath(job_dir)
    job_name = os.path.basename(job_dir.rstrip("/"))
    if not os.path.isfile(os.path.join(job_dir, "meta.json")):
        raise ValueError(f"{job_dir} is not a job folder (no meta.json)")
    # precedence, lowest first: the job, the profile, n_sites (min_clients), then each --set
    from_profile = profile_overrides(load_profile(profile), job_name) if profile else {}
    from_sets: dict = {}
    for expr in sets:
        part, comp_id, arg, value = parse_set(expr)
        if part in ("meta", SHAPE):
            from_sets.setdefault(part, {})[arg] = value
        else:
            from_sets.setdefault(part, {}).setdefault(comp_id, {})[arg] = value
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    shutil.copytree(job_dir, out_dir)
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    meta.update(from_profile.get("meta", {}))
    if n_sites is not None:
        meta["min_clients"] = n_sites
    meta.update(from_sets.get("meta", {}))
    meta["name"] = job_name
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    for app in [d for d in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, d, "config"))]:
        paths = {part: os.path.join(out_dir, app, "config", fname) for part, fname in CONFIG_FILES.items()
                 if os.path.isfile(os.path.join(out_dir, app, "config", fname))}
        configs = {}
        for part, path in paths.items():
            with open(path) as f:
                configs[part] = json.load(f)
        where = f"{job_name}/{app}"
        apply_shape(configs, from_profile.get(SHAPE, {}), f"{where} (profile)")
        for part, config in configs.items():
            for comp_id, args in from_profile.get(part, {}).items():
                override_args(config, comp_id, args, f"{where}/{CONFIG_FILES[part]}")
            if n_sites is not None:
                for comp in _components(config):
                    if "min_clients" in comp.get("args", {}):
                        comp["args"]["min_clients"] = n_sites
        apply_shape(configs, from_sets.get(SHAPE, {}), f"{where} (--set)")
        for part, config in configs.items():
            for comp_id, args in from_sets.get(part, {}).items():
                override_args(config, comp_id, args, f"{where}/{CONFIG_FILES[part]}")
            with open(paths[part], "w") as f:
                json.dump(config, f, indent=2)
    return out_dir


def job_configs(job_dir: str) -> Iterator[tuple[str, dict]]:
    """(path, parsed config) for every FLARE config file of a job folder."""
    for app in sorted(os.listdir(job_dir)):
        cdir = os.path.join(job_dir, app, "config")
        if os.path.isdir(cdir):
            for fname in sorted(os.listdir(cdir)):
                if fname.endswith(".json"):
                    path = os.path.join(cdir, fname)
                    with open(path) as f:
                        yield path, json.load(f)


def component_specs(config: dict) -> list[dict]:
    return [copy.deepcopy(c) for c in _components(config)]
