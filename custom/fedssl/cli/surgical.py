"""``fedssl surgical <verb>``: surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024)) on chest X-rays: the demo on synthetic NIH / CheXpert /
MIMIC data and the centralised baseline of jobs/surgical_cxr."""

from __future__ import annotations

import os

from fedssl.cli import COUNT, POSITIVE, Verb, add_family


def _demo_args(s) -> None:
    s.add_argument("--out", default="runs/surgical_demo")
    s.add_argument("--backbone", default="fedavg", choices=["fedavg", "fedbn", "fedbn_plus"],
                   help="backbone strategy (the job's paper setting fedbn_plus needs ImageNet weights to mean anything)")
    s.add_argument("--rounds", type=COUNT, default=10, help="federated rounds per method")
    s.add_argument("--patients", type=COUNT, default=500, help="synthetic patients per site")
    s.add_argument("--methods", nargs="+", default=["surgical", "vanilla", "partial_loss"],
                   choices=["surgical", "vanilla", "partial_loss", "personalised", "individual"])
    s.add_argument("--lr", type=POSITIVE, default=0.01, help="local learning rate (tiny model, few rounds; paper 5e-5)")
    s.add_argument("--local-epochs", type=COUNT, default=3, help="local epochs per round (paper: 1)")
    s.add_argument("--no-central", action="store_true", help="leave out the centralised baseline row")


def _demo(a) -> None:
    from fedssl.experiments.surgical_demo import run_surgical_demo

    run_surgical_demo(a.out, rounds=a.rounds, n_patients=a.patients, methods=a.methods, lr=a.lr,
                      local_epochs=a.local_epochs, backbone=a.backbone,
                      central=not a.no_central)


def _central_args(c) -> None:
    c.add_argument("--data-root", required=True, help="the sites' data, {site} = site name (e.g. data/{site})")
    c.add_argument("--out", required=True, help="folder for results.json / results.md / auroc.png")
    c.add_argument("--sites", nargs="+", default=["site-1", "site-2"], help="site names (as the simulator's)")
    c.add_argument("--profile", default=None, help="run profile of the job (e.g. quick), as for fedssl simulate")
    c.add_argument("--set", action="append", metavar="PART.ID.ARG=VALUE",
                   help="job override, e.g. client.cxr_trainer.lr=0.01 (repeatable)")
    c.add_argument("--external-test-root", default="", help="MIMIC-CXR-JPG folder evaluated with every class")


def _central(a) -> None:
    from fedssl.experiments.surgical_central import run_centralised, with_external_test_root

    res = run_centralised(a.data_root, a.out, sites=a.sites, profile=a.profile,
                          sets=with_external_test_root(a.set, a.external_test_root))
    m = res["table"]["mean"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ext = res["table"]["external"]
    print(f"centralised: mean AUROC {fmt(m['mean_auroc'])} (shared {fmt(m['shared_auroc'])}, unique "
          f"{fmt(m['unique_auroc'])})" + (f", external {fmt(ext[0]['mean_auroc'])}" if ext else "")
          + f" in {res['wall_time_s']} s -> {os.path.join(os.path.abspath(a.out), 'results.md')}")


VERBS = (
    Verb("demo", "synthetic NIH + CheXpert sites -> surgical vs vanilla vs partial-loss FL in the simulator -> mean "
                 "AUROC table (quick profile, CPU)", _demo_args, _demo, alias="demo-surgical"),
    Verb("central", "centralised baseline of jobs/surgical_cxr: the same training code on the pooled data of every "
                    "site, evaluated like the federated runs", _central_args, _central, alias="surgical-central"),
)


def register(sub) -> None:
    add_family(sub, "surgical", "multi-label chest X-rays with surgical aggregation: demo, centralised baseline", VERBS)
