"""The generic job verbs, at the top level: ``fedssl job | simulate | site-local | deploy-local | submit``."""

from __future__ import annotations

import json

from fedssl.cli import COUNT, NON_NEGATIVE, NON_NEGATIVE_REAL, POSITIVE, SEED, Verb, add_verb


def _job_opts(sp, sites_required: bool = False) -> None:
    """--profile / --set / --sites; ``sites_required`` where the verb starts that many sites."""
    sp.add_argument("--profile", default=None, help="app_config/profiles/<name>.json, e.g. quick")
    sp.add_argument("--set", action="append", default=[], metavar="PART.ID.ARG=VALUE",
                    help="override one argument, e.g. server.scatter_and_gather.num_rounds=5")
    sp.add_argument("--sites", type=COUNT, default=None, required=sites_required,
                    help="number of sites (sets min_clients)")


def _check_jobs(a, jobs: list[str]) -> None:
    """Every override of every job checked (names, types, --sites) before a workspace, a system or a job folder is
    created: a bad value is one error and nothing is left behind."""
    from fedssl.ops.jobs import configured_job

    for job in jobs:
        configured_job(job, profile=a.profile, sets=a.set, n_sites=a.sites)


def _site_local_args(s) -> None:
    s.add_argument("local_dir")


def _site_local(a) -> None:
    from fedssl.ops.policy import write_site_local

    print(f"wrote {write_site_local(a.local_dir)}")


def _job_args(s) -> None:
    s.add_argument("job")
    s.add_argument("out")
    _job_opts(s)


def _job(a) -> None:
    from fedssl.ops.jobs import build_job

    print(build_job(a.job, a.out, profile=a.profile, sets=a.set, n_sites=a.sites))


def _simulate_args(s) -> None:
    s.add_argument("job")
    s.add_argument("-w", "--workspace", required=True)
    s.add_argument("--data-root", required=True, help="data folder; {site} is replaced by the site name")
    s.add_argument("--timeout", type=NON_NEGATIVE_REAL, default=0,
                   help="seconds each attempt may run; 0 = until the run ends")
    s.add_argument("--retries", type=NON_NEGATIVE, default=2,
                   help="how often a run in which FLARE's simulator lost a site's process is started again")
    _job_opts(s, sites_required=True)


def _simulate(a) -> None:
    from fedssl.ops.simulate import run_simulation

    _check_jobs(a, [a.job])
    s = run_simulation(a.job, a.workspace, n_sites=a.sites, data_root=a.data_root, profile=a.profile, sets=a.set,
                       timeout_s=a.timeout or None, retries=a.retries)
    b = s["bytes_per_site_per_round"]
    print(f"done in {s['simulator_wall_time_s']} s; global model {s['global_model']}; "
          f"bytes per site per round: up {b['upload']:.0f}, down {b['download']:.0f}")


def _deploy_local_args(s) -> None:
    s.add_argument("job", nargs="*", help="job folders to submit, in order")
    s.add_argument("-w", "--workspace", required=True)
    s.add_argument("--data-root", required=True, help="each site's data folder; {site} is replaced by the site name")
    s.add_argument("--timeout", type=POSITIVE, default=1800, help="seconds to wait for the jobs")
    s.add_argument("--hold", action="store_true", help="keep the system up after the jobs (for fl_admin.sh)")
    s.add_argument("--faults", default=None, metavar="SCENARIO[,SCENARIO...]",
                   help="fault drill: run the one JOB fault-free, then under each scenario (none, latency, partition, "
                        "resets, kill-site, stop-site, kill-server, or all), each on a fresh system; report in "
                        "WS/fault_drill.json (provisioning/README.md, Fault drill)")
    s.add_argument("--seed", type=SEED, default=0, help="fault drill: seeds the proxies' jitter and reset moments")
    _job_opts(s, sites_required=True)


def _deploy_local(a) -> None:
    from fedssl.ops.deploy import deploy_and_run

    if a.faults is not None:
        return _drill(a)
    _check_jobs(a, a.job)
    leftover = deploy_and_run(a.workspace, a.job, n_sites=a.sites, data_root=a.data_root, profile=a.profile,
                              sets=a.set, timeout_s=a.timeout, hold=a.hold)
    print(f"stopped; leftover processes: {leftover or 'none'}")


def _drill(a) -> None:
    from fedssl.ops.drill import DrillSettings, parse_scenarios, run_drill, table

    if len(a.job) != 1:
        raise ValueError(f"--faults: got {len(a.job)} job folders; the drill runs exactly one JOB, e.g. "
                         "fedssl deploy-local jobs/fcl_acdc --faults latency ...")
    if a.hold:
        raise ValueError("--hold with --faults: the drill stops every system it starts; drop --hold")
    scenarios = parse_scenarios(a.faults)
    DrillSettings().check_sites(scenarios, a.sites)
    _check_jobs(a, a.job)
    report = run_drill(a.job[0], a.workspace, scenarios, n_sites=a.sites, data_root=a.data_root, profile=a.profile,
                       sets=a.set, seed=a.seed, timeout_s=a.timeout)
    print(table(report))
    print(f"drill took {report['drill_wall_s']} s")


def _submit_args(s) -> None:
    s.add_argument("job")
    s.add_argument("--startup-kit", required=True, help="the admin's provisioned folder (contains startup/)")
    s.add_argument("--username", default="admin@fedssl.org")
    s.add_argument("--download", default=None, help="folder for the job result (default: the kit's transfer/)")
    s.add_argument("--timeout", type=NON_NEGATIVE_REAL, default=0, help="seconds to wait; 0 = until the job ends")
    _job_opts(s)


def _submit(a) -> None:
    from fedssl.ops.admin import submit_and_download

    _check_jobs(a, [a.job])
    r = submit_and_download(a.startup_kit, a.username, a.job, profile=a.profile, sets=a.set, n_sites=a.sites,
                            timeout_s=a.timeout, download_to=a.download)
    print(json.dumps(r, indent=1))
    if r["status"] != "FINISHED:COMPLETED":
        raise RuntimeError(f"job {r['job_id']} ended {r['status']}")


VERBS = (
    Verb("site-local", "write local/resources.json allowing the bundle's classes", _site_local_args, _site_local),
    Verb("job", "copy a job folder with a profile / overrides applied", _job_args, _job),
    Verb("simulate", "run a job in the FLARE simulator (-t = -n) and check its results", _simulate_args, _simulate),
    Verb("deploy-local", "provision + start server and N sites on loopback, run jobs, stop everything",
         _deploy_local_args, _deploy_local),
    Verb("submit", "FLARE API: submit a job, monitor it, download its result", _submit_args, _submit),
)


def register(sub) -> None:
    for verb in VERBS:
        add_verb(sub, verb)
