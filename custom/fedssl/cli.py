"""``fedssl`` command line: make synthetic data, build/run jobs with profiles, fine-tune, report, demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

#: modules that add their own subcommands: each defines ``register(sub)`` (sub = argparse subparsers)
COMMAND_MODULES: tuple[str, ...] = ("fedssl.images_cli", "fedssl.sslfl_cli", "fedssl.surgical_cli")


def _cmd_synth(a) -> None:
    from fedssl.data.acdc_synthetic import write_synthetic_acdc

    sites = write_synthetic_acdc(a.out, n_patients=a.patients, n_sites=a.sites, seed=a.seed, shape=(a.size, a.size))
    print(f"wrote {a.patients} synthetic ACDC patients in {len(sites)} site folders under {os.path.abspath(a.out)}")


def _cmd_link_sites(a) -> None:
    from fedssl.data.acdc_synthetic import link_site_folders

    sites = link_site_folders(a.src, a.out, n_sites=a.sites, per_site=a.per_site, seed=a.seed)
    print(json.dumps(sites, indent=1))


def _cmd_site_local(a) -> None:
    from fedssl.policy import write_site_local

    print(f"wrote {write_site_local(a.local_dir)}")


def _cmd_job(a) -> None:
    from fedssl.jobtools import build_job

    print(build_job(a.job, a.out, profile=a.profile, sets=a.set, n_sites=a.sites))


def _cmd_simulate(a) -> None:
    from fedssl.simulate import run_simulation

    s = run_simulation(a.job, a.workspace, n_sites=a.sites, data_root=a.data_root, profile=a.profile, sets=a.set)
    b = s["bytes_per_site_per_round"]
    print(f"done in {s['simulator_wall_time_s']} s; global model {s['global_model']}; "
          f"bytes per site per round: up {b['upload']:.0f}, down {b['download']:.0f}")


def _cmd_export_unet(a) -> None:
    from fedssl.finetune import export_unet_init

    print(export_unet_init(a.pretrained, a.out, a.features))


def _parse_inits(specs: list[str]) -> dict[str, object]:
    from fedssl.finetune import encoder_init

    inits: dict[str, object] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--init {spec!r}: use NAME=PATH_TO_FL_global_model.pt or NAME=random")
        inits[name] = "random" if path == "random" else encoder_init(path)
    return inits


def _cmd_finetune(a) -> None:
    from fedssl.eval.report import format_table, summarise, write_report
    from fedssl.finetune import load_labelled_sites, protocol_settings, run_protocols

    settings = protocol_settings(a.profile)
    if a.epochs:
        settings["epochs"] = a.epochs
    sites = load_labelled_sites(a.data_root, settings)
    rows = run_protocols(sites, _parse_inits(a.init), modes=a.modes, n_labelled=a.n, folds=a.folds, settings=settings,
                         progress=lambda r: print(f"  {r['mode']:<11} {r['method']:<8} N={r['n_labelled']} fold {r['fold']} {r['site']}: Dice {r['dice']:.3f}", flush=True))
    write_report(rows, a.out, title="ACDC fine-tuning", extra={"settings": settings})
    print(format_table(summarise(rows)))


def _cmd_deploy_local(a) -> None:
    from fedssl.deploy import LoopbackDeployment
    from fedssl.jobtools import build_job

    with LoopbackDeployment(a.workspace, n_sites=a.sites, data_root=a.data_root) as d:
        print(f"server and {a.sites} sites up on 127.0.0.1:{d.port} in {d.timings['startup_s']} s "
              f"(admin startup kit: {d.kits['admin@fedssl.org']})", flush=True)
        for job_dir in a.job:
            job = build_job(job_dir, os.path.join(d.workspace, "jobs", os.path.basename(os.path.abspath(job_dir))),
                            profile=a.profile, sets=a.set, n_sites=a.sites)
            r = d.run_job(job, timeout_s=a.timeout)
            print(f"{os.path.basename(job)}: job {r['job_id']} {r['status']} in {r['job_s']} s; result in {r['result_dir']}", flush=True)
            if r["status"] != "FINISHED:COMPLETED":
                raise RuntimeError(f"job {r['job_id']} ended {r['status']}; see {r['result_dir']}")
        if a.hold:
            print("holding the system up; Ctrl-C stops everything", flush=True)
            while True:
                d.check_alive()
                time.sleep(5)
    print(f"stopped; leftover processes: {d.leftover_processes() or 'none'}")


def _cmd_submit(a) -> None:
    from fedssl.admin import submit_and_download

    r = submit_and_download(a.startup_kit, a.username, a.job, profile=a.profile, sets=a.set, n_sites=a.sites,
                            timeout_s=a.timeout, download_to=a.download)
    print(json.dumps(r, indent=1))
    if r["status"] != "FINISHED:COMPLETED":
        raise RuntimeError(f"job {r['job_id']} ended {r['status']}")


def _cmd_table7(a) -> None:
    from fedssl.table7 import run_table7

    run_table7(a.out, n_sites=a.sites, rounds=a.rounds, n_labelled=a.n, epochs=a.epochs, data_root=a.data_root,
               profile=a.profile)


def _cmd_demo(a) -> None:
    from fedssl.demo import run_demo

    run_demo(a.out, n_sites=a.sites, rounds=a.rounds, ft_rounds=a.ft_rounds, n_labelled=a.n, epochs=a.epochs)


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    p = argparse.ArgumentParser(prog="fedssl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("synth", help="write a synthetic dataset in its real on-disk layout")
    s.add_argument("dataset", choices=["acdc"])
    s.add_argument("out")
    s.add_argument("--patients", type=int, default=100)
    s.add_argument("--sites", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--size", type=int, default=128, help="in-plane matrix size of the written volumes")
    s.set_defaults(fn=_cmd_synth)

    s = sub.add_parser("link-sites", help="split a real ACDC training/ folder into site-k folders (symlinks)")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--sites", type=int, default=10)
    s.add_argument("--per-site", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_link_sites)

    s = sub.add_parser("site-local", help="write local/resources.json allowing the bundle's classes")
    s.add_argument("local_dir")
    s.set_defaults(fn=_cmd_site_local)

    def job_opts(sp):
        sp.add_argument("--profile", default=None, help="app_config/profiles/<name>.json, e.g. quick")
        sp.add_argument("--set", action="append", default=[], metavar="PART.ID.ARG=VALUE",
                        help="override one argument, e.g. server.scatter_and_gather.num_rounds=5")
        sp.add_argument("--sites", type=int, default=None, help="number of sites (sets min_clients)")

    s = sub.add_parser("job", help="copy a job folder with a profile / overrides applied")
    s.add_argument("job")
    s.add_argument("out")
    job_opts(s)
    s.set_defaults(fn=_cmd_job)

    s = sub.add_parser("simulate", help="run a job in the FLARE simulator (-t = -n) and check its results")
    s.add_argument("job")
    s.add_argument("-w", "--workspace", required=True)
    s.add_argument("--data-root", required=True, help="data folder; {site} is replaced by the site name")
    job_opts(s)
    s.set_defaults(fn=_cmd_simulate)

    s = sub.add_parser("export-unet", help="pre-trained FL_global_model.pt -> U-Net init checkpoint")
    s.add_argument("pretrained")
    s.add_argument("out")
    s.add_argument("--features", type=int, nargs=6, default=[48, 96, 192, 384, 768, 48])
    s.set_defaults(fn=_cmd_export_unet)

    s = sub.add_parser("finetune", help="local / centralised fine-tuning protocol and Dice table")
    s.add_argument("--data-root", required=True, help="folder with site-* folders")
    s.add_argument("--init", action="append", required=True, metavar="NAME=PATH|random")
    s.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    s.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    s.add_argument("--modes", nargs="+", default=["local"], choices=["local", "centralised"])
    s.add_argument("--profile", default=None)
    s.add_argument("--epochs", type=int, default=None)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=_cmd_finetune)

    s = sub.add_parser("deploy-local", help="provision + start server and N sites on loopback, run jobs, stop everything")
    s.add_argument("job", nargs="*", help="job folders to submit, in order")
    s.add_argument("-w", "--workspace", required=True)
    s.add_argument("--data-root", required=True, help="each site's data folder; {site} is replaced by the site name")
    s.add_argument("--timeout", type=float, default=1800)
    s.add_argument("--hold", action="store_true", help="keep the system up after the jobs (for fl_admin.sh)")
    job_opts(s)
    s.set_defaults(fn=_cmd_deploy_local)

    s = sub.add_parser("submit", help="FLARE API: submit a job, monitor it, download its result")
    s.add_argument("job")
    s.add_argument("--startup-kit", required=True, help="the admin's provisioned folder (contains startup/)")
    s.add_argument("--username", default="admin@fedssl.org")
    s.add_argument("--download", default=None, help="folder for the job result (default: the kit's transfer/)")
    s.add_argument("--timeout", type=float, default=0, help="seconds to wait; 0 = until the job ends")
    job_opts(s)
    s.set_defaults(fn=_cmd_submit)

    s = sub.add_parser("table7", help="seed 004 Table 7: bytes per round (FCL = 1) and Dice, six methods")
    s.add_argument("--out", default="runs/table7")
    s.add_argument("--sites", type=int, default=3)
    s.add_argument("--rounds", type=int, default=11, help="pre-training rounds (11 include two DP calibrations)")
    s.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    s.add_argument("--epochs", type=int, default=None, help="local fine-tuning epochs (default: the profile's)")
    s.add_argument("--data-root", default=None, help="folder with site-* folders (default: synthetic)")
    s.add_argument("--profile", default="quick", help="quick on CPU; paper where a GPU is available")
    s.set_defaults(fn=_cmd_table7)

    s = sub.add_parser("demo", help="synthetic ACDC -> FCL in the simulator -> fine-tuning -> Dice table (quick profile)")
    s.add_argument("--out", default="runs/demo")
    s.add_argument("--sites", type=int, default=3)
    s.add_argument("--rounds", type=int, default=10, help="FCL pre-training rounds")
    s.add_argument("--ft-rounds", type=int, default=10, help="federated fine-tuning rounds")
    s.add_argument("--n", type=int, nargs="+", default=[1, 2])
    s.add_argument("--epochs", type=int, default=None, help="local fine-tuning epochs (default: quick profile)")
    s.set_defaults(fn=_cmd_demo)

    import importlib

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)

    a = p.parse_args(argv)
    try:
        a.fn(a)
    except KeyboardInterrupt:
        print(f"fedssl {a.cmd}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError) as e:
        print(f"fedssl {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
