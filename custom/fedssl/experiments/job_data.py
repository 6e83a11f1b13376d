"""Synthetic site data for any job of the bundle, in the layout its sites read.

``write_job_data("sslfl_mae_retina", root, n_sites=3)`` writes what the job's sites need under ``root`` and returns
the ``data_root`` template (``.../{site}``) that ``fedssl simulate --data-root`` and the benches take.  The sizes
fit the quick profile (small images, few patients): for benches and smoke runs, not for scores; the papers'
tables have their own runners with their own data.
"""

from __future__ import annotations

import os
import shutil

#: job -> the data set its sites read
JOB_DATA = {"fcl_acdc": "acdc", "fcl_acdc_finetune": "acdc", "fclopt_acdc": "acdc", "acdc_seg3d": "acdc",
            "fedmae_derm": "derm", "fedmae_derm_finetune": "derm", "sslfl_mae_retina": "retina",
            "sslfl_beit_retina": "retina", "sslfl_retina_finetune": "retina", "sslfl_mae_covidfl": "covidfl",
            "sslfl_covidfl_finetune": "covidfl", "sslfl_mae_derm": "derm_mel", "sslfl_derm_finetune": "derm_mel",
            "fedclf_derm": "derm_devices", "fedclf_derm_finetune": "derm_devices", "surgical_cxr": "surgical",
            "feddra_mimic": "vlp_mimic", "feddra_retina": "vlp_retina"}


def write_job_data(job: str, root: str, n_sites: int = 1, seed: int = 0) -> str:
    """Write synthetic data for ``n_sites`` sites of ``job`` under ``root`` (kept if already there); returns the
    data root with ``{site}``.  FedCLF's devices are always the paper's 10; surgical aggregation has 2 sites
    (NIH, CheXpert) and FedDRA's retina job 2 (MESSIDOR-2, BRSET)."""
    name = os.path.basename(os.path.normpath(job))
    if name not in JOB_DATA:
        raise ValueError(f"job {name!r} has no synthetic data writer; jobs: {sorted(JOB_DATA)} "
                         "(or give the sites' data with --data-root)")
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise ValueError(f"n_sites={n_sites!r}: use the number of sites, >= 1")
    kind = JOB_DATA[name]
    base = os.path.join(os.path.abspath(root), f"{kind}_{n_sites}_sites_seed{seed}")
    out, raw = os.path.join(base, "sites"), os.path.join(base, "raw")  # the sites' folders; what they were cut from
    done = os.path.join(base, ".complete")
    if not os.path.isfile(done):
        if os.path.isdir(base):
            shutil.rmtree(base)  # a write that stopped part-way
        _WRITERS[kind](out, raw, n_sites, seed)
        with open(done, "w") as f:
            f.write(kind + "\n")
    return os.path.join(out, "{site}")


def _acdc(out: str, raw: str, n_sites: int, seed: int) -> None:
    from fedssl.data.acdc_synthetic import write_synthetic_acdc

    write_synthetic_acdc(out, n_patients=10 * n_sites, n_sites=n_sites, seed=seed)


def _image_sets(dataset: str):
    def write(out: str, raw: str, n_sites: int, seed: int) -> None:
        from fedssl.data.image_sites import write_site_folders
        from fedssl.data.image_synthetic import write_synthetic_images

        write_synthetic_images(raw, dataset, n_images=60 * n_sites + 40, seed=seed, image_size=40)
        release = {"release_split": ""} if dataset in ("covidfl", "derm_mel") else {}  # split the release anew
        write_site_folders(raw, dataset, out, n_sites=n_sites, seed=seed, split="iid" if n_sites == 1 else "dirichlet",
                           **release)
    return write


def _derm_devices(out: str, raw: str, n_sites: int, seed: int) -> None:
    from fedssl.data.fedclf_devices import build_devices
    from fedssl.data.fedclf_synthetic import SOURCES, write_synthetic_derm_sources

    write_synthetic_derm_sources(raw, n_isic=200, seed=seed, image_size=40)
    build_devices(out, *(os.path.join(raw, s) for s in SOURCES), seed=seed, short_edge=36)


def _surgical(out: str, raw: str, n_sites: int, seed: int) -> None:
    from fedssl.data.cxr_synthetic import write_synthetic_surgical

    write_synthetic_surgical(out, n_patients=60, seed=seed, image_size=64)


def _vlp_mimic(out: str, raw: str, n_sites: int, seed: int) -> None:
    from fedssl.data.vlp import load_mimic_vlp, write_client_manifests
    from fedssl.data.vlp_synthetic import write_synthetic_mimic

    write_synthetic_mimic(raw, n_patients=40 * n_sites + 20, image_px=32, seed=seed)
    write_client_manifests(load_mimic_vlp(raw, site="synthetic")[0], out, n_clients=n_sites, alpha=1.0, seed=seed,
                           min_per_client=5)


def _vlp_retina(out: str, raw: str, n_sites: int, seed: int) -> None:
    from fedssl.data.vlp import load_brset, load_messidor2, write_source_manifests
    from fedssl.data.vlp_synthetic import write_synthetic_brset, write_synthetic_messidor2

    write_synthetic_messidor2(os.path.join(raw, "messidor2"), n_images=60, image_px=32, seed=seed)
    write_synthetic_brset(os.path.join(raw, "brset"), n_images=60, image_px=32, seed=seed + 1)
    write_source_manifests({"site-1": load_messidor2(os.path.join(raw, "messidor2"), site="site-1")[0],
                            "site-2": load_brset(os.path.join(raw, "brset"), site="site-2")[0]}, out)


_WRITERS = {"acdc": _acdc, "retina": _image_sets("retina"), "derm": _image_sets("derm"),
            "covidfl": _image_sets("covidfl"), "derm_mel": _image_sets("derm_mel"), "derm_devices": _derm_devices,
            "surgical": _surgical, "vlp_mimic": _vlp_mimic, "vlp_retina": _vlp_retina}
