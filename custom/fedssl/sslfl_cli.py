"""``fedssl`` subcommands of the SSL-FL fine-tuning side: demo, local fine-tuning, encoder export, evaluation."""

from __future__ import annotations

import json


def _cmd_demo(a) -> None:
    from fedssl.sslfl_demo import run_sslfl_demo

    run_sslfl_demo(a.out, methods=a.methods, scratch=not a.no_scratch, n_images=a.images, image_px=a.px, n_sites=a.sites, alpha=a.alpha, pre_rounds=a.pre_rounds,
                   ft_rounds=a.ft_rounds, ft_epochs=a.ft_epochs, ft_steps=a.ft_steps, ft_lr=a.ft_lr, seed=a.seed)


def _settings(a) -> dict:
    from fedssl.models.vit import TINY_VIT

    s = {}
    if a.tiny:
        s.update(image_size=TINY_VIT["img_size"], patch_size=TINY_VIT["patch_size"], embed_dim=TINY_VIT["embed_dim"],
                 depth=TINY_VIT["depth"], num_heads=TINY_VIT["num_heads"], drop_path_rate=0.0, batch_size=32)
    for key in ("epochs", "lr", "label_fraction", "val_fraction", "device"):
        if getattr(a, key, None) is not None:
            s[key] = getattr(a, key)
    if getattr(a, "layer_scale", None) is not None:
        s["layer_scale"] = a.layer_scale
    return s


def _cmd_finetune_vit(a) -> None:
    from fedssl.core.classification import format_metric
    from fedssl.vit_finetune import finetune_local

    inits = {}
    for spec in a.init:
        name, _, path = spec.partition("=")
        if not path:
            raise ValueError(f"--init {spec!r}: use NAME=PATH (pre-training FL_global_model.pt), NAME=scratch or "
                             "NAME=imagenet:PATH")
        inits[name] = ("", "") if path == "scratch" else ("", path[9:]) if path.startswith("imagenet:") else (path, "")
    rows = finetune_local(a.data_root, a.dataset, inits, settings=_settings(a), test_root=a.test_root,
                          progress=(lambda m: print("  " + m, flush=True)) if a.verbose else None)
    for r in rows:
        t = r["test"]
        print(f"{r['method']:<12} {r['site']:<8} best epoch {r['best_epoch']:>3}: test accuracy {format_metric(t['accuracy'])}, "
              f"balanced {format_metric(t['balanced_accuracy'])}, AUC {format_metric(t['auc'])}")
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {a.out}")


def _cmd_export(a) -> None:
    from fedssl.vit_finetune import export_encoder

    print(json.dumps(export_encoder(a.pretrained, a.out)))


def _cmd_evaluate(a) -> None:
    from fedssl.vit_finetune import evaluate_checkpoint

    m = evaluate_checkpoint(a.checkpoint, a.test_root, a.dataset, settings=_settings(a))
    print(json.dumps({k: v for k, v in m.items() if k != "confusion_matrix"}, indent=1))


def _cmd_bench(a) -> None:
    from fedssl.bench import run_bench

    run_bench(a.out, methods=a.methods, size=a.size, batch_sizes=a.batch_sizes, steps=a.steps, warmup=a.warmup,
              amp=not a.no_amp, device=a.device)


def register(sub) -> None:
    s = sub.add_parser("demo-sslfl", help="synthetic retina -> Split-3 -> Fed-MAE (or Fed-BEiT; FedMAE-KS on derm) -> "
                                          "federated fine-tuning vs scratch (quick)")
    s.add_argument("--out", default="runs/sslfl_demo")
    s.add_argument("--methods", nargs="+", default=["fedmae"], choices=["fedmae", "fedbeit", "fedmae_ks"],
                   help="pre-training methods, one data set: fedmae / fedbeit (retina) or fedmae_ks (derm)")
    s.add_argument("--no-scratch", action="store_true", help="leave out the ViT-from-scratch baseline")
    s.add_argument("--images", type=int, default=2800, help="images written (retina: a balanced subset, ~53%%, is kept)")
    s.add_argument("--px", type=int, default=40, help="height of the synthetic fundus images")
    s.add_argument("--sites", type=int, default=5)
    s.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha (0.5 = SSL-FL Split-3)")
    s.add_argument("--pre-rounds", type=int, default=20)
    s.add_argument("--ft-rounds", type=int, default=60)
    s.add_argument("--ft-epochs", type=int, default=1, help="local epochs per fine-tuning round")
    s.add_argument("--ft-steps", type=int, default=4,
                   help="at most this many local steps per epoch (0 = full epochs); few steps limit client drift under Split-3")
    s.add_argument("--ft-lr", type=float, default=0.003)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_demo)

    def vit_opts(sp):
        sp.add_argument("--dataset", default="retina", choices=["retina", "derm", "covidfl"])
        sp.add_argument("--tiny", action="store_true", help="tiny ViT (32 px, patch 4, width 48, depth 2) on CPU")
        sp.add_argument("--layer-scale", type=float, default=None, help="0.1 for a Fed-BEiT encoder")
        sp.add_argument("--device", default=None)

    s = sub.add_parser("finetune-vit", help="local (per-site) ViT fine-tuning: epoch chosen on validation, then test")
    s.add_argument("--data-root", required=True, help="folder with site-* folders (and test/) from `fedssl partition`")
    s.add_argument("--init", action="append", required=True, metavar="NAME=PATH|scratch|imagenet:PATH")
    s.add_argument("--test-root", default="", help="default: DATA_ROOT/test")
    s.add_argument("--epochs", type=int, default=None)
    s.add_argument("--lr", type=float, default=None)
    s.add_argument("--label-fraction", type=float, default=None)
    s.add_argument("--val-fraction", type=float, default=None)
    s.add_argument("--verbose", action="store_true")
    s.add_argument("--out", default="finetune_vit.json")
    vit_opts(s)
    s.set_defaults(fn=_cmd_finetune_vit)

    s = sub.add_parser("export-vit-encoder", help="pre-training FL_global_model.pt -> encoder-only state dict")
    s.add_argument("pretrained")
    s.add_argument("out")
    s.set_defaults(fn=_cmd_export)

    s = sub.add_parser("evaluate-vit", help="test metrics of a fine-tuned checkpoint (refuses an untrained head)")
    s.add_argument("checkpoint")
    s.add_argument("--test-root", required=True)
    vit_opts(s)
    s.set_defaults(fn=_cmd_evaluate)

    b = sub.add_parser("bench-vit", help="training throughput (images/s) of the ViT-B/16 MAE, BEiT and fine-tuning steps")
    b.add_argument("--methods", nargs="+", default=["mae", "beit", "finetune"], choices=["mae", "beit", "finetune"])
    b.add_argument("--size", default="vit_b16", choices=["vit_b16", "tiny"], help="vit_b16 = paper (224 px); tiny = CPU twin")
    b.add_argument("--batch-sizes", nargs="+", type=int, default=[64])
    b.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    b.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    b.add_argument("--no-amp", action="store_true", help="float32 instead of bfloat16 autocast (GPU)")
    b.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda, cuda:1 ...")
    b.add_argument("--out", default=None, help="write the measurements to this JSON file")
    b.set_defaults(fn=_cmd_bench)
