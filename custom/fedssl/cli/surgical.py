"""``fedssl surgical <verb>``: surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024)) on chest X-rays:
the demo on synthetic NIH / CheXpert / MIMIC data, the centralised baseline of jobs/surgical_cxr, the ablation
partitioner (sec. 2.4.1) and the paired comparison of two methods (sec. 2.6)."""

from __future__ import annotations

import os

import json

from fedssl.cli import COUNT, FRACTION, NON_NEGATIVE, POSITIVE, SEED, Verb, add_family, add_threads_argument


def _demo_args(s) -> None:
    s.add_argument("--out", default="runs/surgical_demo")
    s.add_argument("--backbone", default="fedavg", choices=["fedavg", "fedbn", "fedbn_plus"],
                   help="backbone strategy (the job's paper setting fedbn_plus needs ImageNet weights to mean "
                        "anything)")
    s.add_argument("--rounds", type=COUNT, default=10, help="federated rounds per method")
    s.add_argument("--patients", type=COUNT, default=500, help="synthetic patients per site")
    s.add_argument("--methods", nargs="+", default=["surgical", "vanilla", "partial_loss"],
                   choices=["surgical", "vanilla", "partial_loss", "personalised", "individual"])
    s.add_argument("--lr", type=POSITIVE, default=0.01, help="local learning rate (tiny model, few rounds; paper 5e-5)")
    s.add_argument("--local-epochs", type=COUNT, default=3, help="local epochs per round (paper: 1)")
    s.add_argument("--no-central", action="store_true", help="leave out the centralised baseline row")
    s.add_argument("--central-missing", default="negative", choices=["negative", "ignore"],
                   help="centralised baseline: a source's unlabelled classes are negatives (paper) or ignored")
    s.add_argument("--seeds", nargs="+", type=SEED, default=[0],
                   help="training seeds (weights, sampling, each site's split; the data stays); 3 for a finding")
    add_threads_argument(s)


def _demo(a) -> None:
    from fedssl.experiments.surgical_demo import run_surgical_demo

    run_surgical_demo(a.out, rounds=a.rounds, n_patients=a.patients, methods=a.methods, lr=a.lr,
                      local_epochs=a.local_epochs, backbone=a.backbone,
                      central=not a.no_central, central_missing=a.central_missing, threads=a.threads,
                      seeds=a.seeds)


def _central_args(c) -> None:
    c.add_argument("--data-root", required=True, help="the sites' data, {site} = site name (e.g. data/{site})")
    c.add_argument("--out", required=True, help="folder for results.json / results.md / auroc.png")
    c.add_argument("--sites", nargs="+", default=["site-1", "site-2"], help="site names (as the simulator's)")
    c.add_argument("--profile", default=None, help="run profile of the job (e.g. quick), as for fedssl simulate")
    c.add_argument("--set", action="append", metavar="PART.ID.ARG=VALUE",
                   help="job override, e.g. client.cxr_trainer.lr=0.01 (repeatable)")
    c.add_argument("--external-test-root", default="", help="MIMIC-CXR-JPG folder evaluated with every class")
    c.add_argument("--missing-classes", default="negative", choices=["negative", "ignore"],
                   help="a site's unlabelled classes in the pooled data: negatives (paper sec. 2.3 and its public "
                        "code) or ignored (masked out of the loss, as partial loss)")
    c.add_argument("--bn", default="job", choices=["job", "frozen", "trained"],
                   help="batch-norm: as the job's backbone switch (frozen under fedbn_plus, the paper's choice and "
                        "its code's centralised training), or forced")


def _central(a) -> None:
    from fedssl.experiments.surgical_central import run_centralised, with_external_test_root

    res = run_centralised(a.data_root, a.out, sites=a.sites, profile=a.profile,
                          sets=with_external_test_root(a.set, a.external_test_root), missing=a.missing_classes,
                          freeze_bn={"job": None, "frozen": True, "trained": False}[a.bn])
    m = res["table"]["mean"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ext = res["table"]["external"]
    print(f"centralised: mean AUROC {fmt(m['mean_auroc'])} (shared {fmt(m['shared_auroc'])}, unique "
          f"{fmt(m['unique_auroc'])})" + (f", external {fmt(ext[0]['mean_auroc'])}" if ext else "")
          + f" in {res['wall_time_s']} s -> {os.path.join(os.path.abspath(a.out), 'results.md')}")


def _partition_args(p) -> None:
    p.add_argument("--out", required=True, help="folder for site-1 .. site-K, nih_test and partition.json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--nih-root", default="", help="the NIH ChestX-ray14 folder (Data_Entry_2017_v2020.csv + images)")
    src.add_argument("--synthetic", type=COUNT, default=0, metavar="PATIENTS",
                     help="a synthetic NIH-like source of this many patients instead (+ a MIMIC-like external set)")
    p.add_argument("--clients", type=COUNT, required=True, help="number of clients K (paper: 2 to 10)")
    p.add_argument("--shared", type=NON_NEGATIVE, required=True,
                   help="classes held by every client (0 to 14); the others are each held by one client")
    p.add_argument("--holdout", type=FRACTION, default=0.2, help="fraction of patients in the held-out NIH test set")
    p.add_argument("--seed", type=SEED, default=0)


def _partition(a) -> None:
    from fedssl.experiments.surgical_ablation import PARTITION_FILE, partition

    rec = partition(a.out, a.clients, a.shared, nih_root=a.nih_root, synthetic_patients=a.synthetic, seed=a.seed,
                    holdout=a.holdout)
    for site, info in rec["sites"].items():
        print(f"{site}: {info['n_patients']} patients, {info['n_images']} images, {len(info['classes'])} classes")
    print(f"held-out NIH test set: {rec['held_out']['n_patients']} patients -> {os.path.join(a.out, 'nih_test')}")
    sets = " ".join(f"--set '{s}'" for s in rec["sets"])
    print(f"run it: fedssl simulate jobs/surgical_cxr -w WORKSPACE --sites {rec['n_sites']} --data-root "
          f"{rec['data_root']} {sets}  (all in {os.path.join(a.out, PARTITION_FILE)})")


def _compare_args(c) -> None:
    c.add_argument("--a", nargs="+", required=True, metavar="RESULTS",
                   help="method A: results.json file(s) or run folders")
    c.add_argument("--b", nargs="+", required=True, metavar="RESULTS", help="method B, in the same (seed) order")
    c.add_argument("--on", default="test", choices=["test", "external"],
                   help="the sites' test sets or the external set")
    c.add_argument("--out", default="", help="also write the comparison as JSON here")


def _compare(a) -> None:
    from fedssl.experiments.surgical_ablation import compare_runs

    res = compare_runs(a.a, a.b, a.on)
    t, w = res["t_test"], res["wilcoxon"]
    print(f"{len(res['pairs'])} {res['unit']}-level pairs ({a.on}): mean difference A - B {t['mean_diff']:+.4f}; "
          f"paired t-test t = {t['t']:.3f} (df {t['df']}), p = {t['p']:.4g}; Wilcoxon signed-rank W+ = "
          f"{w['w_plus']:g}, W- = {w['w_minus']:g}, p = {w['p']:.4g}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


VERBS = (
    Verb("demo", "synthetic NIH + CheXpert sites -> surgical vs vanilla vs partial-loss FL in the simulator -> mean "
                 "AUROC table (quick profile, CPU)", _demo_args, _demo),
    Verb("central", "centralised baseline of jobs/surgical_cxr: the same training code on the pooled data of every "
                    "site, evaluated like the federated runs", _central_args, _central),
    Verb("partition", "ablation data (paper sec. 2.4.1): IID subsets of NIH for K clients with S shared classes and a "
                      "held-out NIH test set, plus the job overrides to run them", _partition_args, _partition),
    Verb("compare", "paired t-test and Wilcoxon signed-rank test of two methods from their results.json (per class, "
                    "or per seed with several runs each; paper sec. 2.6)", _compare_args, _compare),
)


def register(sub) -> None:
    add_family(sub, "surgical", "multi-label chest X-rays with surgical aggregation: demo, centralised baseline, "
                                "ablation partitioner, paired comparison", VERBS)
