"""Job-folder tools: apply a run profile (paper / quick) or single overrides to a copy of a job.

Job folders under ``jobs/`` hold the paper's settings.  A profile (``app_config/profiles/<name>.json``)
names, per job, the component ids whose ``args`` change::

    {"description": "...",
     "jobs": {"fcl_acdc": {"meta":   {"min_clients": 3},
                           "server": {"scatter_and_gather": {"num_rounds": 2}},
                           "client": {"fcl_trainer": {"image_size": 64}}}}}

``"*"`` instead of a job name applies to every job.  Besides the components, a profile or ``--set`` may name
``meta`` (meta.json keys), ``shape`` (a model argument of every component), ``wire`` (quantised messages) and
``runner`` (FLARE's server runner settings, the top-level ``"server"`` object of ``config_fed_server.json``:
``--set runner.task_request_interval=0.2`` has idle sites ask for their next task after 0.2 s instead of FLARE's
2 s, which is most of a short simulator round).  Every component id must exist in the job, and every
overridden argument must be a constructor argument of the component's class (the class its ``path`` names, and
the base classes its ``**kwargs`` reach) with a value of the declared type: ``5`` where ``int`` is declared, any
number for ``float``, ``true`` / ``false`` for ``bool`` (never ``1``), a list for ``Sequence[int]``.  A typo or a
value of the wrong type is an error naming the component, the argument and what it takes, raised before anything
is written -- never a silently ignored override nor a job that fails on the sites.  The values themselves are
left to the constructors' own checks (nothing is instantiated here).

The folder is built beside the destination and moved in only when complete, so a failed build leaves whatever
was there (a job folder built before) as it was.  The result is a normal job folder that ``nvflare simulator``
or ``submit_job`` take as they are.
"""

from __future__ import annotations

import collections.abc
import copy
import errno
import functools
import importlib
import inspect
import json
import math
import os
import shutil
import tempfile
import types
import typing
from typing import Any, Iterator

from fedssl.core.checks import require_int

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PROFILES_DIR = os.path.join(REPO_ROOT, "app_config", "profiles")
CONFIG_FILES = {"server": "config_fed_server.json", "client": "config_fed_client.json"}
#: the meta.json keys a profile or ``--set meta.KEY=VALUE`` may set, with the type FLARE reads them as
META_KEYS: dict[str, Any] = {"min_clients": int, "mandatory_clients": list[str], "deploy_map": dict,
                             "resource_spec": dict}
#: FLARE server runner settings (``config_fed_server.json``, ``"server": {...}``) a profile or ``--set runner.KEY``
#: may set: FLARE 2.9 reads these two, each a positive number of seconds
RUNNER_KEYS: dict[str, str] = {
    "task_request_interval": "seconds after which a site with no task asks again (FLARE default 2)",
    "heart_beat_timeout": "seconds without a heartbeat after which the server drops a site (FLARE default 60)"}
#: ``--set rounds.missing_sites=K`` (or a profile's ``"rounds"``): a round goes on without up to K sites (issue 46).
#: FedAvg-style rounds allow it; these workflows need every site and refuse it, naming why
NEEDS_EVERY_SITE: dict[str, str] = {
    "fedssl.flare.federated_vocabulary.FederatedVocabulary": "FedDRA's vocabulary is built from every site's words",
    "fedssl.flare.surgical_registration.ClassRegistration": "every site registers its classes before round 0",
    "fedssl.flare.federated_kmeans.FederatedKMeans": "Fed-BEiT's tokenizer k-means averages every site's statistics",
}
#: how messages say what JSON values look like (``--set`` values are parsed as JSON)
JSON_HINT = 'values are JSON: 5, 0.1, true, "text", [1, 2]'


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


def read_json(path: str) -> Any:
    """The content of a JSON file; a syntax error names the file (json's own message does not)."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def _read_object(path: str) -> dict:
    content = read_json(path)
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a JSON object, found {_json_kind(content)}")
    return content


# ---- what a component's constructor takes -------------------------------------------------------------------


def component_class(comp: dict, where: str) -> type:
    """The class a component's ``path`` names; a path that does not import or names no class is an error naming
    the component."""
    path = comp["path"]
    module, _, name = str(path).rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}: component {comp['id']!r}: path {path!r} does not import ({e})") from None
    if not inspect.isclass(obj):
        raise ValueError(f"{where}: component {comp['id']!r}: path {path!r} is not a class")
    return obj


@functools.lru_cache(maxsize=None)
def constructor_parameters(cls: type) -> dict[str, Any]:
    """name -> resolved annotation of every named constructor argument of ``cls`` and of the base classes its
    ``**kwargs`` are passed on to (FCLOptController hands ScatterAndGather's on).  An argument without an
    annotation maps to ``inspect.Parameter.empty`` and takes any JSON value: a default is no declaration
    (MultiLabelExecutor's ``dataset=""`` also takes an object keyed by site name)."""
    params: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if klass is object or init is None:
            continue  # object takes no arguments; a class without its own __init__ hands on to the next one
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - a name importable only for type checkers: leave those unchecked
            hints = {}
        named = list(inspect.signature(init).parameters.values())[1:]  # without self
        for p in named:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                params.setdefault(p.name, hints.get(p.name, inspect.Parameter.empty))
        if not any(p.kind is p.VAR_KEYWORD for p in named):
            break
    return params


_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.MutableSequence,
              collections.abc.Set, collections.abc.MutableSet)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _fits(value: Any, annotation: Any) -> bool | None:
    """Whether a JSON value fits ``annotation``: int for ``int`` (never a bool, never 5.0), int or float for
    ``float``, bool for ``bool``, a list (with fitting items) for a sequence, an object for a mapping, null for
    None.  None = the annotation says nothing a JSON value can be checked against (``Any``, a class such as
    ``torch.nn.Module``): the constructor decides."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    if annotation is None or annotation is type(None):
        return value is None
    if isinstance(value, dict) and any(k in value for k in ("path", "class_path", "name")):
        return None  # a nested component FLARE builds into an object before calling the constructor
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        known = [f for f in (_fits(value, a) for a in args) if f is not None]
        return any(known) if known else None
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    container = origin or annotation
    if container in _MAPPINGS:
        return isinstance(value, dict) and (len(args) != 2 or all(
            _fits(v, args[1]) is not False for v in value.values()))
    if container in _SEQUENCES:
        if not isinstance(value, list):
            return False
        if container is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) is not False for v, a in zip(value, args))
        return not args or all(_fits(v, args[0]) is not False for v in value)
    return None


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a JSON value (``--set lr=NaN`` parses, and strict JSON cannot hold it)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, words in ((bool, "true/false"), (int, "an integer"), (float, "a number with a fraction"),
                        (str, "a string"), (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return words
    return type(value).__name__


def check_argument(comp: dict, arg: str, value: Any, where: str) -> None:
    """Refuse an override the component's class cannot take: no such constructor argument (the message lists the
    ones it has), a value whose JSON type does not fit the declared type, or NaN / infinity."""
    cls = component_class(comp, where)
    params = constructor_parameters(cls)
    name = f"{where}: component {comp['id']!r} ({comp['path']})"
    if arg not in params:
        raise ValueError(f"{name} has no argument {arg!r}; it accepts {sorted(params)}")
    if not _finite(value):
        raise ValueError(f"{name}: argument {arg}={value!r} is not a finite number")
    declared = params[arg]
    if _fits(value, declared) is False:
        raise ValueError(f"{name}: argument {arg}={value!r} is {_json_kind(value)}, but {cls.__name__} takes "
                         f"{_json_type(declared)} ({JSON_HINT})")


def _json_type(annotation: Any) -> str:
    """A declared type as the JSON it takes: a sequence is ``list`` (``list[int]``), a mapping ``object``."""
    origin, args = typing.get_origin(annotation) or annotation, typing.get_args(annotation)
    inner = f"[{', '.join('...' if a is Ellipsis else _json_type(a) for a in args)}]" if args else ""
    if origin in _SEQUENCES:
        return f"list{inner}"
    if origin in _MAPPINGS:
        return "object"
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_json_type(a) for a in args)
    return "null" if annotation is type(None) else inspect.formatannotation(annotation)


def check_binds(comp: dict, where: str) -> None:
    """The component's full ``args`` bind to its constructor (a required argument missing is reported too)."""
    try:
        inspect.signature(component_class(comp, where)).bind(**comp.get("args", {}))
    except TypeError as e:
        raise ValueError(f"{where}: component {comp['id']!r} ({comp['path']}): its args do not fit the "
                         f"constructor: {e}") from None


# ---- overrides ----------------------------------------------------------------------------------------------


class _Touched:
    """The components overrides changed, each set through :func:`check_argument`; at the end their full args
    must bind (:func:`check_binds`)."""

    def __init__(self) -> None:
        self.components: dict[int, tuple[dict, str]] = {}

    def set(self, comp: dict, arg: str, value: Any, where: str) -> None:
        check_argument(comp, arg, value, where)
        comp.setdefault("args", {})[arg] = value
        self.components.setdefault(id(comp), (comp, where))

    def check_binds(self) -> None:
        for comp, where in self.components.values():
            check_binds(comp, where)


def override_args(config: dict, comp_id: str, args: dict, where: str, touched: _Touched) -> None:
    """Set ``args`` of the component ``comp_id`` (exactly one in ``config``), each checked by :func:`check_argument`."""
    matches = [c for c in _components(config) if c["id"] == comp_id]
    if len(matches) != 1:
        ids = sorted({c["id"] for c in _components(config)})
        raise ValueError(f"{where}: component id {comp_id!r} found {len(matches)} times; ids in this config: {ids}")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: the overrides of {comp_id!r} must be an object of argument: value, not {args!r}")
    for k, v in args.items():
        touched.set(matches[0], k, v, where)


def apply_meta(meta: dict, values: dict, where: str) -> None:
    """Set meta.json keys (only those in :data:`META_KEYS`, each of its type)."""
    for key, value in values.items():
        if key not in META_KEYS:
            raise ValueError(f"{where}: meta key {key!r} cannot be set; settable keys: {sorted(META_KEYS)}")
        if _fits(value, META_KEYS[key]) is False:
            raise ValueError(f"{where}: meta {key}={value!r} is {_json_kind(value)}, but FLARE reads "
                             f"{inspect.formatannotation(META_KEYS[key])} ({JSON_HINT})")
        meta[key] = value


def _merge_profile(base: dict, over: dict) -> dict:
    """``over`` deep-merged onto ``base``: objects merge key by key, anything else (numbers, lists) replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_profile(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_profile(profile: str, _seen: tuple[str, ...] = ()) -> dict:
    """A profile by name (``app_config/profiles/<name>.json``) or as the path of a JSON file.

    A profile may start from another: ``"extends": "quick"`` takes that profile and deep-merges this one's keys
    onto it (objects key by key, other values replace), so a profile states only what it changes (the bench
    profile is quick with more pre-training).  A cycle of ``extends`` is an error naming the chain."""
    path = profile if os.path.isfile(profile) else os.path.join(PROFILES_DIR, f"{profile}.json")
    if not os.path.isfile(path):
        names = (sorted(p[:-5] for p in os.listdir(PROFILES_DIR) if p.endswith(".json")) if os.path.isdir(PROFILES_DIR)
                 else [])
        raise ValueError(f"profile {profile!r} not found: no such file, nor {path}; available: {names}")
    content = _read_object(path)
    base = content.pop("extends", None)
    if base is None:
        return content
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: 'extends' must name a profile (e.g. \"quick\"), found {base!r}")
    if base in _seen + (profile,):
        raise ValueError(f"{path}: profiles extend each other in a cycle: {' -> '.join(_seen + (profile, base))}")
    return _merge_profile(load_profile(base, _seen + (profile,)), content)


#: the part of a profile / ``--set`` that names the job's model shape once (``shape.image_size=64``): it applies
#: to every component of the job, client and server, that takes the argument
SHAPE = "shape"
#: the part that switches what travels in fewer bytes, for both directions (``--set wire.weights=float16``)
WIRE = "wire"
#: the part that sets FLARE's server runner settings (``--set runner.task_request_interval=0.2``)
RUNNER = "runner"
#: the part that lets rounds go on without some sites (``--set rounds.missing_sites=1``)
ROUNDS = "rounds"
PARTS = ("meta", SHAPE, WIRE, RUNNER, ROUNDS, *CONFIG_FILES)
SCALAR_PARTS = ("meta", SHAPE, WIRE, RUNNER, ROUNDS)  # PART.KEY=VALUE, no component id


def profile_overrides(profile: dict, job_name: str) -> dict:
    """The profile's overrides of ``job_name``: its ``"*"`` entry, then its own; an unknown part (``clinet``) or
    a part that is not an object of objects is an error."""
    jobs = profile.get("jobs", {})
    merged: dict = {}
    for key in ("*", job_name):
        for part, comps in jobs.get(key, {}).items():
            if part not in PARTS or not isinstance(comps, dict):
                raise ValueError(f"profile, job {key!r}: {part!r} must be one of {list(PARTS)} and hold an object")
            target = merged.setdefault(part, {})
            for comp_id, args in comps.items():
                if part in SCALAR_PARTS:
                    target[comp_id] = args
                elif not isinstance(args, dict):
                    raise ValueError(f"profile, job {key!r}: {part}.{comp_id} must be an object of argument: value")
                else:
                    target.setdefault(comp_id, {}).update(args)
    return merged


def apply_shape(configs: dict[str, dict], shape: dict, where: str, touched: _Touched) -> None:
    """Set each ``shape`` argument in every component (of every config) that has it; an argument no component
    takes is an error (a typo must not pass silently)."""
    for arg, value in shape.items():
        hits = [c for config in configs.values() for c in _components(config) if arg in c.get("args", {})]
        if not hits:
            raise ValueError(f"{where}: shape argument {arg!r} is not an argument of any component of this job; "
                             "shape names model arguments shared by the server and the sites (e.g. image_size)")
        for comp in hits:
            touched.set(comp, arg, value, where)


#: wire.KEY -> the values it takes: model weights through FLARE's quantisation filters, feature banks in float16
WIRE_CHOICES = {"weights": ("float16", "blockwise8", "float4", "normfloat4", "adaquant"), "banks": ("float16",)}
METER_PATH = "fedssl.flare.communication_meter.CommunicationMeter"
_QUANTIZATION = "fedssl.flare.quantization"


def _meter_index(filters: list) -> int | None:
    return next((i for i, f in enumerate(filters) if isinstance(f, dict) and f.get("path") == METER_PATH), None)


def _client_entry(entries: list, tasks: list[str]) -> list:
    """The filter list of the client entry for exactly ``tasks``, or of a new entry for them; a task already in
    another entry is an error (FLARE takes one filter list per task)."""
    for entry in entries:
        if sorted(entry.get("tasks", [])) == sorted(tasks):
            return entry.setdefault("filters", [])
        if set(entry.get("tasks", [])) & set(tasks):
            raise ValueError(f"client filters cover tasks {entry.get('tasks')} and the server meters {tasks}: "
                             "the wire switch needs the same task groups on both sides")
    entries.append({"tasks": list(tasks), "filters": []})
    return entries[-1]["filters"]


def apply_wire(configs: dict[str, dict], wire: dict, where: str) -> None:
    """Put the wire filters into the app, for every task group the server's communication meters count.

    ``weights``: the quantiser (:class:`fedssl.flare.quantization.Quantizer`) last on the sending side, just
    before the server's download meter; the dequantiser first on the receiving side, just after the server's
    upload meter.  ``banks``: :class:`~fedssl.flare.quantization.BankPrecision` before the quantiser.  The meters
    then count the bytes that travel."""
    for key, value in wire.items():
        if key not in WIRE_CHOICES:
            raise ValueError(f"{where}: wire key {key!r} is unknown; use {sorted(WIRE_CHOICES)} "
                             "(e.g. --set wire.weights=float16)")
        if value not in WIRE_CHOICES[key]:
            raise ValueError(f"{where}: wire.{key}={value!r}; use one of {list(WIRE_CHOICES[key])}")
    server, client = configs.get("server"), configs.get("client")
    if server is None or client is None:
        raise ValueError(f"{where}: the wire switch needs both the server and the client config in this app")

    def sending() -> list[dict]:
        out = [{"id": "wire_banks", "path": f"{_QUANTIZATION}.BankPrecision", "args": {"precision": wire["banks"]}}] \
            if "banks" in wire else []
        if "weights" in wire:
            out.append({"id": "wire_quantizer", "path": f"{_QUANTIZATION}.Quantizer",
                        "args": {"quantization_type": wire["weights"]}})
        return out

    def receiving() -> list[dict]:
        return [{"id": "wire_dequantizer", "path": f"{_QUANTIZATION}.Dequantizer",
                 "args": {"quantization_type": wire["weights"]}}] if "weights" in wire else []

    downloads, uploads = [], []  # the task groups of the server's download / upload meters
    for entry in server.get("task_data_filters", []):
        i = _meter_index(entry.get("filters", []))
        if i is not None:
            entry["filters"][i:i] = sending()
            downloads.append(list(entry.get("tasks", [])))
    for entry in server.get("task_result_filters", []):
        i = _meter_index(entry.get("filters", []))
        if i is not None:
            entry["filters"][i + 1:i + 1] = receiving()
            uploads.append(list(entry.get("tasks", [])))
    if not downloads or not uploads:
        raise ValueError(f"{where}: the wire switch finds the exchanged tasks by the server's communication meters "
                         f"({METER_PATH}) of both directions; this app has "
                         f"{'none' if not downloads + uploads else 'one'}")
    for tasks in downloads:  # what the site receives: the dequantiser first
        _client_entry(client.setdefault("task_data_filters", []), tasks)[0:0] = receiving()
    for tasks in uploads:  # what the site sends: banks, then the quantiser, last
        _client_entry(client.setdefault("task_result_filters", []), tasks).extend(sending())


def apply_runner(server: dict, values: dict, where: str) -> None:
    """Set FLARE's server runner settings (:data:`RUNNER_KEYS`) in the top-level ``"server"`` object of the
    server config; a key FLARE does not read, or a value that is not a positive finite number, is an error."""
    for key, value in values.items():
        if key not in RUNNER_KEYS:
            raise ValueError(f"{where}: runner key {key!r} is unknown; settable: "
                             + "; ".join(f"{k} ({v})" for k, v in RUNNER_KEYS.items()))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value <= 0:
            raise ValueError(f"{where}: runner.{key}={value!r}; use a positive number of seconds, "
                             f"e.g. --set runner.{key}=0.5 ({RUNNER_KEYS[key]})")
        block = server.setdefault("server", {})
        if not isinstance(block, dict):
            raise ValueError(f"{where}: the server config's \"server\" entry is {block!r}, not an object")
        block[key] = value


def apply_missing_sites(files: dict[str, dict], rounds: dict, job_name: str) -> None:
    """``rounds.missing_sites=K``: every round workflow (one with ``num_rounds`` and ``min_clients``) and meta.json's
    ``min_clients`` need K sites fewer than configured (after ``--sites`` / ``--set``), so a round goes on without a
    site that is dead, partitioned or too slow (after the workflow's ``wait_time_after_min_received``); a site that
    comes back gets the next round's task with the current global model.  The paper settings keep every site (K = 0).
    A job with a workflow of :data:`NEEDS_EVERY_SITE`, a K that leaves fewer than one site, or an unknown key is an
    error naming the fix."""
    for key in rounds:
        if key != "missing_sites":
            raise ValueError(f"{job_name}: rounds.{key} is unknown; settable: rounds.missing_sites (sites a round may "
                             "go without, default 0)")
    k = rounds["missing_sites"]
    require_int(f"{job_name} (rounds)", "missing_sites", k, 0, "use the number of sites a round may go without, e.g. 1")
    if k == 0:
        return
    for rel, config in files.items():
        for comp in _components(config):
            if comp.get("path") in NEEDS_EVERY_SITE:
                raise ValueError(f"{job_name}: {comp['path'].rsplit('.', 1)[-1]} needs every site "
                                 f"({NEEDS_EVERY_SITE[comp['path']]}); rounds.missing_sites must be 0 for this job")
    targets = [(f"{rel}: {c['id']}", c["args"]) for rel, config in files.items() if rel != "meta.json"
               for c in _components(config) if {"min_clients", "num_rounds"} <= set(c.get("args", {}))]
    if "min_clients" in files["meta.json"]:
        targets.append(("meta.json", files["meta.json"]))
    for where, holder in targets:
        n = holder["min_clients"]
        if n - k < 1:
            raise ValueError(f"{job_name}/{where}: min_clients={n} with rounds.missing_sites={k} leaves no site; "
                             f"use missing_sites <= {n - 1}")
        holder["min_clients"] = n - k


def parse_set(expr: str) -> tuple[str, str, str, Any]:
    """``client.fcl_trainer.lr=0.1`` -> ("client", "fcl_trainer", "lr", 0.1); ``meta.min_clients=3`` and
    ``shape.image_size=64`` (every component of the job that takes image_size) too.  The value is JSON; text
    that is not JSON stays a string (and fails the type check where the argument is not a string)."""
    if "=" not in expr:
        raise ValueError(f"--set {expr!r}: expected PART.ID.ARG=VALUE, e.g. client.fcl_trainer.lr=0.1")
    lhs, raw = expr.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    parts = lhs.split(".")
    if parts[0] in SCALAR_PARTS and len(parts) == 2:
        return parts[0], "", parts[1], value
    if len(parts) != 3 or parts[0] not in CONFIG_FILES:
        raise ValueError(f"--set {expr!r}: expected server.ID.ARG=VALUE, client.ID.ARG=VALUE, shape.ARG=VALUE, "
                         "wire.KEY=VALUE, runner.KEY=VALUE, rounds.missing_sites=K or meta.KEY=VALUE")
    return parts[0], parts[1], parts[2], value


def _sets_overrides(sets: list[str]) -> dict:
    from_sets: dict = {}
    for expr in sets:
        part, comp_id, arg, value = parse_set(expr)
        if part in SCALAR_PARTS:
            from_sets.setdefault(part, {})[arg] = value
        else:
            from_sets.setdefault(part, {}).setdefault(comp_id, {})[arg] = value
    return from_sets


def _configured_meta(job_dir: str, job_name: str, profile: str | None, from_profile: dict, from_sets: dict,
                     n_sites: int | None) -> dict:
    meta = _read_object(os.path.join(job_dir, "meta.json"))
    where = f"{job_name}/meta.json"
    apply_meta(meta, from_profile.get("meta", {}), f"{where} (profile)")
    if n_sites is not None:
        meta["min_clients"] = n_sites
    apply_meta(meta, from_sets.get("meta", {}), f"{where} (--set)")
    if "min_clients" in meta:
        require_int(where, "min_clients", meta["min_clients"], 1, "use the number of sites a run needs, >= 1")
    meta["name"] = job_name
    if profile:  # what the run's first line reports (fedssl.flare.run_check); a job folder as it is: the paper's
        meta["profile"] = os.path.splitext(os.path.basename(profile))[0]
    return meta


def _configured_app(job_dir: str, app: str, job_name: str, from_profile: dict, from_sets: dict,
                    n_sites: int | None) -> dict[str, dict]:
    """{path relative to the job: config} of one app with every override applied and checked."""
    rels = {part: os.path.join(app, "config", fname) for part, fname in CONFIG_FILES.items()
            if os.path.isfile(os.path.join(job_dir, app, "config", fname))}
    configs = {part: _read_object(os.path.join(job_dir, rel)) for part, rel in rels.items()}
    where = f"{job_name}/{app}"
    touched = _Touched()
    apply_shape(configs, from_profile.get(SHAPE, {}), f"{where} (profile)", touched)
    for part, config in configs.items():
        for comp_id, args in from_profile.get(part, {}).items():
            override_args(config, comp_id, args, f"{where}/{CONFIG_FILES[part]} (profile)", touched)
        if n_sites is not None:
            for comp in _components(config):
                if "min_clients" in comp.get("args", {}):
                    touched.set(comp, "min_clients", n_sites, f"{where}/{CONFIG_FILES[part]} (--sites)")
    apply_shape(configs, from_sets.get(SHAPE, {}), f"{where} (--set)", touched)
    for part, config in configs.items():
        for comp_id, args in from_sets.get(part, {}).items():
            override_args(config, comp_id, args, f"{where}/{CONFIG_FILES[part]} (--set)", touched)
    touched.check_binds()
    wire = {**from_profile.get(WIRE, {}), **from_sets.get(WIRE, {})}
    if wire:
        apply_wire(configs, wire, where)
    runner = {**from_profile.get(RUNNER, {}), **from_sets.get(RUNNER, {})}
    if runner and "server" in configs:
        apply_runner(configs["server"], runner, f"{where}/{CONFIG_FILES['server']}")
    return {rels[part]: config for part, config in configs.items()}


# ---- writing the folder -------------------------------------------------------------------------------------


def _check_destination(job_dir: str, out_dir: str) -> None:
    """Refuse a destination whose replacement would destroy something that is not a built job: the job folder
    itself (or a folder inside it or around it), a file or link, a non-empty folder without meta.json."""
    real_job, real_out = os.path.realpath(job_dir), os.path.realpath(out_dir)
    if os.path.commonpath([real_job, real_out]) in (real_job, real_out):
        raise ValueError(f"{out_dir}: the output folder must not be the job folder {job_dir}, lie inside it or "
                         "contain it; choose a folder elsewhere")
    if os.path.islink(out_dir) or (os.path.lexists(out_dir) and not os.path.isdir(out_dir)):
        raise ValueError(f"{out_dir}: exists and is not a folder; remove it or choose another output folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "meta.json")):
        raise ValueError(f"{out_dir}: exists and is not a job folder (no meta.json), so it is not replaced; choose "
                         "a new or empty folder, or one a previous build wrote")


def _move_into_place(new: str, out_dir: str) -> None:
    """Rename ``new`` to ``out_dir``; a folder already there is renamed aside first, put back if the rename
    fails, and removed only once the new one is in place."""
    if not os.path.isdir(out_dir):
        os.rename(new, out_dir)
        return
    parent, name = os.path.split(out_dir)
    old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
    os.rename(out_dir, old)  # onto the empty placeholder
    try:
        os.rename(new, out_dir)
    except OSError:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old)


def _write_folder(job_dir: str, out_dir: str, files: dict[str, dict]) -> None:
    """Copy ``job_dir`` with ``files`` (path relative to the folder -> JSON content) rewritten into a new folder
    beside ``out_dir``, then move it to ``out_dir``; on any failure the new folder is removed and ``out_dir`` is
    as it was."""
    parent, name = os.path.split(out_dir)
    if os.path.lexists(parent) and not os.path.isdir(parent):  # makedirs would say only "File exists"
        raise NotADirectoryError(errno.ENOTDIR, "is not a folder, so the output cannot go inside it", parent)
    os.makedirs(parent, exist_ok=True)
    new = tempfile.mkdtemp(prefix=f".{name}.new-", dir=parent)
    try:
        shutil.copytree(job_dir, new, dirs_exist_ok=True)  # also copies the job folder's mode over mkdtemp's 0700
        for rel, content in files.items():
            with open(os.path.join(new, rel), "w") as f:
                json.dump(content, f, indent=2)
        _move_into_place(new, out_dir)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def _source(job_dir: str) -> tuple[str, str]:
    src = os.path.abspath(job_dir)
    if not os.path.isfile(os.path.join(src, "meta.json")):
        raise ValueError(f"{src} is not a job folder (no meta.json)")
    return src, os.path.basename(src)


def configured_job(job_dir: str, profile: str | None = None, sets: list[str] = (),
                   n_sites: int | None = None) -> dict[str, dict]:
    """{path relative to the job folder: content} of meta.json and every config with the overrides applied and
    checked (see the module docstring), nothing written: ``fedssl simulate`` / ``deploy-local`` / ``submit``
    call it before they create anything, :func:`build_job` before it writes.

    Precedence, lowest first: the job, the profile's ``shape``, the profile's component overrides, ``n_sites``
    (``min_clients`` in meta.json and in every workflow that has it), ``--set shape.*``, the other ``--set``
    overrides (e.g. ``min_clients=2`` to tolerate one failed site out of three).
    """
    src, job_name = _source(job_dir)
    if n_sites is not None:
        require_int("build_job", "n_sites", n_sites, 1, "use the number of sites, >= 1 (--sites)")
    from_profile = profile_overrides(load_profile(profile), job_name) if profile else {}
    from_sets = _sets_overrides(list(sets))
    files = {"meta.json": _configured_meta(src, job_name, profile, from_profile, from_sets, n_sites)}
    for app in sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d, "config"))):
        files.update(_configured_app(src, app, job_name, from_profile, from_sets, n_sites))
    rounds = {**from_profile.get(ROUNDS, {}), **from_sets.get(ROUNDS, {})}
    if rounds:
        apply_missing_sites(files, rounds, job_name)
    if (from_profile.get(RUNNER) or from_sets.get(RUNNER)) and \
            not any(k.endswith(CONFIG_FILES["server"]) for k in files):
        raise ValueError(f"{job_name}: runner settings are FLARE server settings, and this job has no "
                         f"{CONFIG_FILES['server']}")
    return files


def build_job(job_dir: str, out_dir: str, profile: str | None = None, sets: list[str] = (),
              n_sites: int | None = None) -> str:
    """Copy ``job_dir`` to ``out_dir`` with the profile and ``--set`` overrides applied (:func:`configured_job`);
    returns ``out_dir``.  Everything is checked before anything is written; ``out_dir`` is replaced only by a
    complete folder, and only if it is new, empty or a job folder (a previous build)."""
    src, _ = _source(job_dir)
    dst = os.path.abspath(out_dir)
    _check_destination(src, dst)
    _write_folder(src, dst, configured_job(src, profile, sets, n_sites))
    return out_dir


def job_configs(job_dir: str) -> Iterator[tuple[str, dict]]:
    """(path, parsed config) for every FLARE config file of a job folder."""
    for app in sorted(os.listdir(job_dir)):
        cdir = os.path.join(job_dir, app, "config")
        if os.path.isdir(cdir):
            for fname in sorted(os.listdir(cdir)):
                if fname.endswith(".json"):
                    path = os.path.join(cdir, fname)
                    yield path, read_json(path)


def component_specs(config: dict) -> list[dict]:
    return [copy.deepcopy(c) for c in _components(config)]
