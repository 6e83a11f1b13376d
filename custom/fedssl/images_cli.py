"""``fedssl synth-images`` and ``fedssl partition``: synthetic SSL-FL image data sets and their site folders."""

from __future__ import annotations

import os
import time

from fedssl.data.images import DATASETS


def _cmd_synth_images(a) -> None:
    from fedssl.data.image_synthetic import write_synthetic_images

    t = time.perf_counter()
    info = write_synthetic_images(a.out, a.dataset, a.images, seed=a.seed, image_size=a.size, n_sources=a.sources)
    counts = ", ".join(f"{k} {v}" for k, v in info["class_counts"].items())
    print(f"wrote {a.images} synthetic {a.dataset} images ({a.size} px) under {os.path.abspath(a.out)} "
          f"in {time.perf_counter() - t:.1f} s")
    print(f"classes: {counts}")
    print(f"sources: {', '.join(f'{k} {v}' for k, v in info['sources'].items())}")


def _cmd_partition(a) -> None:
    from fedssl.data.image_sites import format_partition_table, write_site_folders

    part = write_site_folders(a.src, a.dataset, a.out, n_sites=a.sites, alpha=a.alpha, seed=a.seed,
                              test_fraction=a.test_fraction, min_per_site=a.min_per_site)
    how = "real sites" if a.dataset == "covidfl" else f"Dirichlet alpha={a.alpha}"
    print(f"{part['n_sites']} site folders + test/ under {os.path.abspath(a.out)} ({how}, seed {a.seed}, "
          f"images as {part['files']}s); counts in partition.json:")
    print(format_partition_table(part))


def register(sub) -> None:
    s = sub.add_parser("synth-images", help="write a synthetic retina / derm / covidfl data set in its real layout")
    s.add_argument("dataset", choices=list(DATASETS))
    s.add_argument("out")
    s.add_argument("--images", type=int, default=2000, help="total number of images")
    s.add_argument("--size", type=int, default=64, help="image height in pixels")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--sources", type=int, default=None,
                   help="acquisition sources (retina/derm default 4; covidfl real sites, 1-8, default 8)")
    s.set_defaults(fn=_cmd_synth_images)

    s = sub.add_parser("partition", help="held-out test set + Dirichlet (or COVID-FL real-site) site folders")
    s.add_argument("dataset", choices=list(DATASETS))
    s.add_argument("src", help="the full data set in its real layout")
    s.add_argument("out")
    s.add_argument("--sites", type=int, default=None,
                   help="retina/derm: Dirichlet sites (default 5); covidfl: default one per real site")
    s.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha: 100 / 1.0 / 0.5 = Split-1 / 2 / 3")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--test-fraction", type=float, default=0.2)
    s.add_argument("--min-per-site", type=int, default=10, help="minimum training images per site (SSL-FL: 10)")
    s.set_defaults(fn=_cmd_partition)
