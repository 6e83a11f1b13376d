"""``fedssl bench ...``: what federation costs -- server aggregation time and memory as sites are added, and the
bytes the wire switches save against the score they cost."""

from __future__ import annotations

from fedssl.cli import COUNT, NON_NEGATIVE, POSITIVE, SEED, Verb, add_family, add_threads_argument


def _aggregation_args(s) -> None:
    s.add_argument("--sites", nargs="+", type=COUNT, default=[2, 5, 10, 20, 50], help="numbers of contributions")
    s.add_argument("--modes", nargs="+", default=["running", "flare"], choices=["running", "flare", "held", "paired"],
                   help="running = the bundle's aggregator (running sum, every check); flare = FLARE's "
                        "InTimeAccumulateWeightedAggregator on the same contributions; held = every model held, "
                        "then averaged; paired = both in one process, each contribution to one then the other "
                        "(times only, robust to a changing load)")
    s.add_argument("--model", default="vit_b16", choices=["vit_b16", "tiny"], help="vit_b16 = 86.6 M parameters")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--out", default=None, help="write the rows to this JSON file")


def _aggregation(a) -> None:
    from fedssl.experiments.server_scaling import run_scaling

    run_scaling(a.out, sites=a.sites, modes=a.modes, seed=a.seed, model=a.model)


def _sites_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for data, workspaces, site_scaling.json and .png (resumable)")
    s.add_argument("--sites", nargs="+", type=COUNT, default=[2, 5, 10, 20], help="numbers of sites")
    s.add_argument("--modes", nargs="+", default=["simulator", "provisioned"], choices=["simulator", "provisioned"],
                   help="simulator = nvflare simulator -n N -t N; provisioned = server, N sites and the admin on "
                        "loopback, each started from its startup kit")
    s.add_argument("--timeout", type=POSITIVE, default=1800, help="seconds to wait for each job")


def _sites(a) -> None:
    from fedssl.experiments.site_scaling import run_site_scaling

    run_site_scaling(a.out, sites=a.sites, modes=a.modes, timeout_s=a.timeout, say=lambda m: print(m, flush=True))


def _wire_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for data, workspaces, cells/ and wire_cost.json (resumable)")
    s.add_argument("--methods", nargs="+", default=["fcl", "fedmae"], choices=["fcl", "fedmae"])
    s.add_argument("--settings", nargs="+", default=["none", "float16", "adaquant", "float16+banks"],
                   choices=["none", "float16", "adaquant", "float16+banks", "blockwise8", "normfloat4"],
                   help="wire settings; blockwise8 / normfloat4 need a GPU (FLARE runs them on CUDA)")
    s.add_argument("--repeats", type=COUNT, default=2, help="runs of 'none' (seeds 0..R-1): the run-to-run spread")
    s.add_argument("--paired", action="store_true",
                   help="every setting over the same seeds as 'none' (paired differences)")
    s.add_argument("--pre-rounds", type=COUNT, default=4)
    s.add_argument("--ft-rounds", type=COUNT, default=4)


def _wire(a) -> None:
    from fedssl.experiments.wire_cost import run_wire_cost

    run_wire_cost(a.out, methods=a.methods, settings=a.settings, repeats=a.repeats, pre_rounds=a.pre_rounds,
                  ft_rounds=a.ft_rounds, paired=a.paired)


def _overhead_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for data, the simulator workspace and overhead.json")
    s.add_argument("--job", default="fcl_acdc_finetune", help="job name under jobs/ or a job folder")
    s.add_argument("--data-root", default=None,
                   help="site data with {site}; default: synthetic data of the job's kind for one site")
    s.add_argument("--profile", default="quick", help="profile of the job (quick: CPU sizes)")
    s.add_argument("--set", action="append", default=[], metavar="PART.ID.ARG=VALUE", help="override, as fedssl job")
    s.add_argument("--rounds", type=COUNT, default=5)


def _overhead(a) -> None:
    from fedssl.experiments.overhead import run_overhead

    run_overhead(a.out, job=a.job, data_root=a.data_root, profile=a.profile, sets=a.set, rounds=a.rounds)


def _message_args(s) -> None:
    s.add_argument("--jobs", nargs="+", default=["fcl_acdc", "fcl_acdc_finetune", "sslfl_mae_retina"],
                   help="job names under jobs/ or job folders")
    s.add_argument("--profiles", nargs="+", default=["quick", "paper"], help="model sizes: the profiles to size at")
    s.add_argument("--settings", nargs="+", default=["none", "float16", "adaquant"],
                   choices=["none", "float16", "adaquant", "blockwise8", "float4", "normfloat4"],
                   help="wire quantisers to size; blockwise8 / float4 / normfloat4 need CUDA (FLARE 2.9)")
    s.add_argument("--out", default=None, help="write the rows to this JSON file")


def _message(a) -> None:
    import json

    from fedssl.experiments.wire_cost import format_message_sizes, message_sizes

    rows = [message_sizes(job, profile, a.settings) for job in a.jobs for profile in a.profiles]
    print(format_message_sizes(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


def _evidence_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for the data, evidence.json and evidence.png")
    s.add_argument("--size", default="gpu", choices=["gpu", "tiny"],
                   help="gpu = the papers' model sizes (FCL: 10 sites, U-Net 48, 192 px; Fed-MAE: see "
                        "experiments/evidence_mae.py); tiny = toy sizes for a CPU")
    s.add_argument("--seeds", nargs="+", type=SEED, default=[0, 1, 2])
    s.add_argument("--methods", nargs="+", default=["fcl", "fedmae"], choices=["fcl", "fedmae"])
    s.add_argument("--budget-s", type=POSITIVE, default=480.0,
                   help="wall seconds for the whole command; rounds and epochs are chosen to fit")
    s.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1 ...")
    s.add_argument("--workers", type=COUNT, default=None, help="fine-tuning processes (gpu: 8, tiny: 2)")
    s.add_argument("--fcl-rounds", type=COUNT, default=None, help="FCL pre-training rounds (default: the budget's)")
    s.add_argument("--fcl-epochs", type=COUNT, default=None, help="fine-tuning epochs (default: the budget's)")
    s.add_argument("--mae-pretrain-rounds", type=COUNT, default=None)
    s.add_argument("--mae-finetune-rounds", type=COUNT, default=None)


def _evidence(a) -> None:
    from fedssl.experiments.evidence import run_evidence

    rounds = {"fcl_rounds": a.fcl_rounds, "fcl_epochs": a.fcl_epochs, "mae_pretrain": a.mae_pretrain_rounds,
              "mae_finetune": a.mae_finetune_rounds}
    run_evidence(a.out, size=a.size, seeds=a.seeds, device=a.device, budget_s=a.budget_s, methods=a.methods,
                 rounds={k: v for k, v in rounds.items() if v is not None}, workers=a.workers,
                 say=lambda m: print(m, flush=True))


def _control_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for the data, encoders/, control.json and control.png "
                                                "(resumable: a second call skips what is done)")
    s.add_argument("--size", default="bench", choices=["bench", "tiny"],
                   help="bench = the bench profile's FCL settings (10 sites, U-Net 8, 64 px); tiny = toy sizes")
    s.add_argument("--multipliers", nargs="*", type=COUNT, default=[1, 4, 16],
                   help="centralised pre-training steps, in multiples of one site's steps in the bench run (none: "
                        "random init and the federated arms only)")
    s.add_argument("--federated-multipliers", nargs="*", type=COUNT, default=[1],
                   help="federated pre-training rounds, in multiples of the bench run's (none: random init and the "
                        "centralised arm only)")
    s.add_argument("--resend-multipliers", nargs="*", type=COUNT, default=[],
                   help="the federated arm with the feature exchange before issue 45 (whole banks re-sent every "
                        "round), to measure what sending each feature once costs")
    s.add_argument("--seeds", nargs="+", type=SEED, default=[0, 1, 2])
    s.add_argument("--folds", nargs="+", type=NON_NEGATIVE, default=[0], choices=range(5))
    s.add_argument("--first-seed-only", nargs="*", type=COUNT, default=[],
                   help="multipliers that run only the first seed")
    s.add_argument("--budget-s", type=POSITIVE, default=None, help="no cell starts after this many wall seconds")
    s.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda ...")
    s.add_argument("--report-only", action="store_true", help="only the table, verdicts and PNG of control.json")
    s.add_argument("--merge", nargs="+", default=None, metavar="FOLDER",
                   help="merge these control folders (seeds run as separate processes) into --out and report; "
                        "nothing is computed")
    add_threads_argument(s)


def _control(a) -> None:
    from fedssl.experiments.control import control_report, fcl_control, merge_controls

    say = lambda m: print(m, flush=True)  # noqa: E731
    if a.merge:
        merge_controls(a.out, a.merge, say=say)
        return
    if a.report_only:
        control_report(a.out, say=say)
        return
    fcl_control(a.out, multipliers=a.multipliers, seeds=a.seeds, federated_multipliers=a.federated_multipliers,
                folds=a.folds, size=a.size, device=a.device, first_seed_only=a.first_seed_only, budget_s=a.budget_s,
                resend_multipliers=a.resend_multipliers, threads=a.threads, say=say)


def _loss_trace_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for the data and loss_trace_*.json / .png (a control folder "
                                                "reuses its data)")
    s.add_argument("--size", default="bench", choices=["bench", "tiny"])
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--multiplier", type=COUNT, default=1, help="pre-training steps in multiples of the bench run's")
    s.add_argument("--no-structural-matching", action="store_true",
                   help="FCL's local term alone (no global structural matching): is the remote term what moves it?")
    s.add_argument("--probe-slices", type=COUNT, default=400, help="fixed slices of the bank-free measure")
    s.add_argument("--no-fresh-bank", action="store_true",
                   help="skip scoring the same queries against a bank encoded now (halves the time)")
    s.add_argument("--device", default="cpu")
    add_threads_argument(s)


def _loss_trace(a) -> None:
    from fedssl.experiments.control import loss_trace
    from fedssl.experiments.environment import set_threads

    set_threads(a.threads)
    loss_trace(a.out, seed=a.seed, multiplier=a.multiplier, structural_matching=not a.no_structural_matching,
               size=a.size, probe_slices=a.probe_slices, fresh_bank=not a.no_fresh_bank, device=a.device,
               say=lambda m: print(m, flush=True))


def _fcl_step_args(s) -> None:
    s.add_argument("--out", required=True, help="folder for one synthetic site and fcl_step.json")
    s.add_argument("--size", default="gpu", choices=["gpu", "tiny"])
    s.add_argument("--device", default="auto")
    s.add_argument("--steps", type=COUNT, default=10, help="timed steps of each measurement")


def _fcl_step(a) -> None:
    from fedssl.experiments.fcl_step import fcl_step_breakdown

    fcl_step_breakdown(a.out, size=a.size, device=a.device, steps=a.steps, say=lambda m: print(m, flush=True))


VERBS = (
    Verb("aggregation", "server scaling: time and peak memory of aggregating 2..50 ViT-B/16 contributions "
                        "(the bundle's FedAvgAggregator against FLARE's, one process per count)", _aggregation_args,
         _aggregation),
    Verb("control", "FCL's centralised control (issue 44 H2): one trainer on all sites' data pooled at 1x, 4x, 16x the "
                    "bench pre-training steps, and the federated run, against random init in Table 1 local "
                    "fine-tuning over seeds; JSON, PNG, one verdict per arm and multiplier", _control_args, _control),
    Verb("evidence", "one GPU command, at most 9 minutes: FCL at the paper's model size (Table 1, N = 1 and 2) and "
                     "Fed-MAE at Split-3 against random init over 3 seeds; JSON, PNG and one verdict per method",
         _evidence_args, _evidence),
    Verb("fcl-step", "where an FCL pre-training step and a fine-tuning step spend their time on the device: data, "
                     "compute, workers, amp, channels_last", _fcl_step_args, _fcl_step),
    Verb("loss-trace", "why FCL's logged local loss rises as the learning rate decays: the centralised pre-training "
                       "with a bank-free InfoNCE of fixed views after every round; JSON and PNG",
         _loss_trace_args, _loss_trace),
    Verb("message", "bytes of a job's model message as sent and through each wire quantiser, at the profiles' "
                    "model sizes (no training)", _message_args, _message),
    Verb("overhead", "the same local training as a bare loop and as a FLARE simulator job: time per round and what "
                     "the difference is made of", _overhead_args, _overhead),
    Verb("sites", "2 to 20 sites of a small job (FCL quick) in the simulator and provisioned on loopback: server "
                  "peak memory, round time and the admin console's answer time; JSON, table and PNG", _sites_args,
         _sites),
    Verb("wire", "bytes per round against score for the wire switches (FLARE quantisation filters, float16 banks): "
                 "FCL and Fed-MAE pre-training + fine-tuning at the quick profile", _wire_args, _wire),
)


def register(sub) -> None:
    add_family(sub, "bench", "cost of federation: FLARE overhead per round, server aggregation scaling, bytes on the "
                             "wire", VERBS)
