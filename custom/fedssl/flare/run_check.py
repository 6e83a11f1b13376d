"""What a run is about to be, said in its first lines, and a simulator run that cannot finish stopped at once.

At the start of a run the server logs the sites connected against the job's ``min_clients`` (meta.json), the
device of this machine and the job's profile (``paper`` for a folder under ``jobs/``, else the profile ``fedssl job``
recorded in meta.json).  After the first round it logs the round's wall time and the whole run's at that pace.

Two causes a newcomer meets with ``nvflare simulator jobs/<job> -w WS -n 2`` get one line that names the fix:

- **fewer simulated sites than the job's ``min_clients``**: the workflow would wait for ever for the missing sites
  (in the simulator no site can join later), so the run is stopped at its start;
- **the paper's scale on a CPU**: the job folders hold the papers' settings, written for ten sites and a GPU; the
  run goes on (a user may mean it), and the line names the quick profile.

In a deployment FLARE's scheduler starts a job only once ``min_clients`` sites are connected; a site lost later is
a fault the workflow tolerates, so outside the simulator nothing is stopped here, only said.
"""

from __future__ import annotations

import json
import os

from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants

#: the job id FLARE's simulator gives every run (``SimulatorConstants.JOB_NAME``): its run folder's name
SIMULATOR_JOB_ID = "simulate_job"
#: the profile of a job folder as it is under ``jobs/`` (meta.json has no ``profile``): the paper's settings
PAPER_PROFILE = "paper"
#: a meta.json larger than this is not read (it is the job author's file, but a run should not choke on it)
MAX_META_BYTES = 1 << 20


def read_meta(run_dir: str) -> dict:
    """The run's meta.json as a dict; {} when it is missing, too large or not a JSON object."""
    path = os.path.join(run_dir, "meta.json")
    try:
        if os.path.getsize(path) > MAX_META_BYTES:
            return {}
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _min_clients(meta: dict) -> int | None:
    n = meta.get("min_clients")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _job_name(meta: dict) -> str:
    name = meta.get("name")
    return name if isinstance(name, str) and name.isidentifier() else "<job>"


def profile_of(meta: dict) -> str:
    profile = meta.get("profile")
    return profile if isinstance(profile, str) and profile else PAPER_PROFILE


def quick_profile_command(meta: dict, n_sites: int) -> str:
    """The command that builds the job at the CPU profile for ``n_sites`` sites."""
    job = _job_name(meta)
    return f"fedssl job jobs/{job} runs/{job}_quick --profile quick --sites {max(1, n_sites)}"


def start_report(meta: dict, n_sites: int, *, simulated: bool, device: str) -> tuple[str, str | None]:
    """(the line a run starts with, the reason to stop it or None).  A stop only in the simulator, where the
    number of sites is fixed: fewer than ``min_clients`` would wait for ever."""
    need, profile = _min_clients(meta), profile_of(meta)
    line = (f"{_job_name(meta)}: {n_sites} site(s) connected, the job needs {need if need else 'any number'} "
            f"(min_clients); device {device}; profile {profile}")
    if simulated and need is not None and n_sites < need:
        return line, (f"{_job_name(meta)} was written for {need} sites and the simulator runs {n_sites}: it would "
                      f"wait for ever. Build it for {n_sites}: {quick_profile_command(meta, n_sites)} "
                      f"(or --profile paper --sites {n_sites} to keep the paper's settings), then simulate that folder")
    if profile == PAPER_PROFILE and device == "cpu":
        line += (f"; these are the paper's settings, written for a GPU: on a CPU use the quick profile, "
                 f"{quick_profile_command(meta, n_sites)}")
    return line, None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pace_report(round_s: float, num_rounds: object) -> str:
    """The first round's wall time and the whole run's at that pace."""
    line = f"first round took {_duration(round_s)}"
    if isinstance(num_rounds, int) and not isinstance(num_rounds, bool) and num_rounds > 1:
        line += f"; {num_rounds} rounds at this pace: about {_duration(round_s * num_rounds)}"
    return line


def announce_start(component: FLComponent, fl_ctx: FLContext) -> None:
    """Log :func:`start_report`'s line; in the simulator with too few sites, log the fix and stop the run."""
    import torch  # the server process has it already (the persistor); imported here to keep this module light

    engine = fl_ctx.get_engine()
    job_id = fl_ctx.get_job_id()
    meta = read_meta(engine.get_workspace().get_run_dir(job_id))
    line, stop = start_report(meta, len(engine.get_clients()), simulated=job_id == SIMULATOR_JOB_ID,
                              device="cuda" if torch.cuda.is_available() else "cpu")
    component.log_info(fl_ctx, line)
    if stop:  # FLARE logs the reason once: 'Aborting current RUN due to FATAL_SYSTEM_ERROR received: <stop>'
        component.system_panic(stop, fl_ctx)


def announce_pace(component: FLComponent, fl_ctx: FLContext, round_s: float) -> None:
    component.log_info(fl_ctx, pace_report(round_s, fl_ctx.get_prop(AppConstants.NUM_ROUNDS)))
