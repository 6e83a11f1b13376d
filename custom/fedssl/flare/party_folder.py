"""Where a FLARE party keeps its secrets (``fedssl.core.party_secret``): its own folder, never the job's.

- A provisioned deployment (or POC): the party's site config dir, ``<its workspace>/local``
  (``Workspace.get_site_config_dir()``, the same call on the server and on a client), which lives as long as the
  startup kit and which no other party reads.
- The FLARE simulator deletes every party's workspace, ``local`` included, before each run (it keeps only the
  top-level ``<workspace>/local``, which it copies into every party's, so all would share it).  There
  ``fedssl.ops.simulate.run_simulation`` sets ``FEDSSL_SECRETS_DIR`` to ``<workspace>_secrets`` beside the
  workspace, and each party uses ``$FEDSSL_SECRETS_DIR/<its name>/``: rerunning into the same workspace repeats
  the secrets, another workspace draws new ones.  It must be an absolute path; leave it unset in a deployment.

Either way each party's secret is drawn from the operating system in its own folder: none is derived from a seed
or from another party's.
"""

from __future__ import annotations

import os
import re

from nvflare.apis.fl_context import FLContext

from fedssl.core.party_secret import party_secret

#: the environment variable that moves every party's secrets to ``<dir>/<party name>/`` (the simulator's case)
SECRETS_DIR_ENV = "FEDSSL_SECRETS_DIR"
_PARTY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")


def party_folder(fl_ctx: FLContext, who: str) -> str:
    """The folder of the party running ``fl_ctx`` (``who``: the component asking, for the error line)."""
    override = os.environ.get(SECRETS_DIR_ENV)
    if override:
        if not os.path.isabs(override):  # the simulator changes each party's working directory
            raise RuntimeError(f"{who}: {SECRETS_DIR_ENV}={override} is not an absolute path; give the full path")
        name = fl_ctx.get_identity_name()
        if not isinstance(name, str) or not _PARTY.fullmatch(name):
            raise RuntimeError(f"{who}: party name {name!r} is no folder name under {SECRETS_DIR_ENV}={override}")
        return os.path.join(override, name)
    engine = fl_ctx.get_engine()
    if engine is None:
        raise RuntimeError(f"{who}: no FLARE engine in the context, so no site config dir to keep the party's secret "
                           f"in (set {SECRETS_DIR_ENV} outside FLARE)")
    return engine.get_workspace().get_site_config_dir()


def flare_party_secret(fl_ctx: FLContext, name: str, who: str) -> int:
    """The secret ``name`` of the party running ``fl_ctx``, in :func:`party_folder`."""
    return party_secret(party_folder(fl_ctx, who), name)
