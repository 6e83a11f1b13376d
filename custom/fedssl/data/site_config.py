"""How a site finds its data: the site's own config, else the job's argument, else an environment variable.

A job folder never bakes in a site's paths, and a site's own settings beat a job's: a job that names a data root
cannot point a site that configured its own at other files.  Each site resolves its data root, in order, from:
1. ``data_root`` in ``<site workspace>/local/fedssl_site.json`` (production: written by the site admin);
2. the executor argument ``data_root`` when it is not empty (simulator / quick experiments, where sites have no
   config of their own);
3. the environment variable ``FEDSSL_DATA_ROOT`` of the client process.
``{site}`` in the value is replaced by the site's name, so one simulator setting serves every site.  Other per-site
settings (:func:`resolve_site_setting`: ``classes``, ``dataset`` ...) follow the same order.

Experiments that run every site on one machine find them as the ``site-*`` folders of one root
(:func:`site_folders`), in site number order.
"""

from __future__ import annotations

import json
import os

SITE_CONFIG_FILE = "fedssl_site.json"
ENV_DATA_ROOT = "FEDSSL_DATA_ROOT"


def site_folders(data_root, make_hint: str = "", required: bool = True) -> dict[str, str]:
    """The ``site-*`` folders of ``data_root``: name -> path, numbered sites by number (site-2 before site-10), then
    any others by name.  None found -> ValueError naming the root and ``make_hint`` (how to write them), or ``{}``
    when not ``required``."""
    root = os.fspath(data_root)
    if not os.path.isdir(root):
        raise ValueError(f"data root {root} is not a directory; check the path")
    names = [d for d in os.listdir(root) if d.startswith("site-") and os.path.isdir(os.path.join(root, d))]
    if not names and required:
        raise ValueError(f"no site-* folder under {root}" + (f"; {make_hint}" if make_hint else ""))
    key = lambda d: (0, int(d[5:]), "") if d[5:].isdigit() else (1, 0, d)  # noqa: E731
    return {d: os.path.join(root, d) for d in sorted(names, key=key)}


def read_site_config(site_config_dir: str | None) -> dict:
    if not site_config_dir:
        return {}
    path = os.path.join(site_config_dir, SITE_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"site config {path} is not valid JSON ({e}); fix or remove it") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"site config {path} must hold a JSON object like {{\"data_root\": \"/data/acdc\"}}")
    return cfg


def resolve_data_root(arg: str, site: str, site_config_dir: str | None = None) -> str:
    """The site's data root (module docstring: the site's config, then the job's ``arg``, then the environment)."""
    cfg = read_site_config(site_config_dir)
    source, value = f"{os.path.join(site_config_dir or '', SITE_CONFIG_FILE)}", cfg.get("data_root", "")
    if not value:
        source, value = "executor argument data_root", arg
    if not value:
        source, value = f"environment variable {ENV_DATA_ROOT}", os.environ.get(ENV_DATA_ROOT, "")
    if not value:
        raise ValueError(
            f"{site}: no data root configured; set data_root in {SITE_CONFIG_FILE} in the site's local/ folder, "
            f"or export {ENV_DATA_ROOT}=/path/to/data (use {{site}} for per-site folders)"
        )
    root = os.path.abspath(os.path.expanduser(value.replace("{site}", site)))
    if not os.path.isdir(root):
        raise ValueError(f"{site}: data root {root} (from {source}) is not a directory; check the path")
    return root


def _for_site(value, site: str, source: str):
    """A plain value serves every site; a JSON object is keyed by site name (one simulator setting for all sites)."""
    if isinstance(value, dict):
        if site not in value:
            raise ValueError(f"{site}: {source} maps sites {sorted(value)} but has no entry for {site}; add one")
        return value[site]
    return value


def resolve_site_setting(arg, key: str, site: str, site_config_dir: str | None = None):
    """A per-site setting other than the data root (e.g. ``classes``, ``dataset``): ``(value, source)``.

    Resolved, in order, from ``key`` in the site's ``local/fedssl_site.json``, then the executor argument ``arg``
    when not empty (a site's own settings beat a job's).  Either may be a plain value (every site) or an object
    keyed by site name, e.g. ``{"site-1": [...], "site-2": [...]}``.  Nothing configured -> ValueError naming the
    site and both places.
    """
    empty = (None, "", [], {})
    path = os.path.join(site_config_dir or "", SITE_CONFIG_FILE)
    own = read_site_config(site_config_dir).get(key)
    if own not in empty:
        source, value = path, _for_site(own, site, path)
    else:
        source = f"executor argument {key}"
        value = _for_site(arg, site, source) if arg not in empty else arg
    if value in empty:
        raise ValueError(f"{site}: no {key} configured; set {key!r} in {SITE_CONFIG_FILE} in the site's local/ folder "
                         f"or the executor argument {key} (a value, or an object mapping site names to values)")
    return value, source
