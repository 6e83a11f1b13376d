"""``fedssl bench ...``: what federation costs -- server aggregation time and memory as sites are added."""

from __future__ import annotations

from fedssl.cli import COUNT, SEED, Verb, add_family


def _aggregation_args(s) -> None:
    s.add_argument("--sites", nargs="+", type=COUNT, default=[2, 5, 10, 20], help="numbers of contributions")
    s.add_argument("--modes", nargs="+", default=["running"], choices=["running", "held"],
                   help="running = the bundle's aggregator (running sum); held = every model held, then averaged")
    s.add_argument("--model", default="vit_b16", choices=["vit_b16", "tiny"], help="vit_b16 = 86.6 M parameters")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--out", default=None, help="write the rows to this JSON file")


def _aggregation(a) -> None:
    from fedssl.experiments.server_scaling import run_scaling

    run_scaling(a.out, sites=a.sites, modes=a.modes, seed=a.seed, model=a.model)


VERBS = (
    Verb("aggregation", "server scaling: time and peak memory of aggregating 2..20 ViT-B/16 contributions "
                        "(FedAvgAggregator, one process per count)", _aggregation_args, _aggregation),
)


def register(sub) -> None:
    add_family(sub, "bench", "cost of federation: server aggregation scaling", VERBS)
