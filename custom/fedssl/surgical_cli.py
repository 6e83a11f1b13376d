"""``fedssl demo-surgical``: the surgical-aggregation demo (seed 002) on synthetic NIH / CheXpert / MIMIC data."""

from __future__ import annotations


def _cmd_demo_surgical(a) -> None:
    from fedssl.surgical_demo import run_surgical_demo

    run_surgical_demo(a.out, rounds=a.rounds, n_patients=a.patients, methods=a.methods, lr=a.lr,
                      local_epochs=a.local_epochs, backbone=a.backbone)


def register(sub) -> None:
    s = sub.add_parser("demo-surgical", help="synthetic NIH + CheXpert sites -> surgical vs vanilla vs partial-loss "
                                             "FL in the simulator -> mean AUROC table (quick profile, CPU)")
    s.add_argument("--out", default="runs/surgical_demo")
    s.add_argument("--backbone", default="fedavg", choices=["fedavg", "fedbn", "fedbn_plus"],
                   help="backbone strategy (the job's paper setting fedbn_plus needs ImageNet weights to mean anything)")
    s.add_argument("--rounds", type=int, default=10, help="federated rounds per method")
    s.add_argument("--patients", type=int, default=500, help="synthetic patients per site")
    s.add_argument("--methods", nargs="+", default=["surgical", "vanilla", "partial_loss"],
                   choices=["surgical", "vanilla", "partial_loss", "personalised", "individual"])
    s.add_argument("--lr", type=float, default=0.01, help="local learning rate (tiny model, few rounds; paper 5e-5)")
    s.add_argument("--local-epochs", type=int, default=3, help="local epochs per round (paper: 1)")
    s.set_defaults(fn=_cmd_demo_surgical)
