"""Fine-tuning entry points shared by the CLI and the demo: load sites, load inits, run protocols, report."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from fedssl.core.safe_load import safe_load
from fedssl.data.acdc import load_site
from fedssl.data.site_config import site_folders as _site_folders
from fedssl.data.volume import Volume
from fedssl.train.protocol import LABELLED_FROM, centralised_finetune, evaluate_per_site, local_finetune
from fedssl.train.segmentation import init_unet
from fedssl.models.unet import UNet2D, encoder_state_from_global, load_encoder_into_unet, require_norm, state_norm
from fedssl.ops.jobs import load_profile

#: ``norm``: the U-Net's normalisation, the pre-training's ("batch", the reference code's, as jobs/fcl_acdc and
#: jobs/fclopt_acdc; "instance" for an encoder pre-trained with ``norm: "instance"``)
PAPER_PROTOCOL = {"image_size": 192, "target_spacing": 1.25, "features": [48, 96, 192, 384, 768, 48], "epochs": 200,
                  "lr": 5e-4, "device": "auto", "min_steps": 0, "norm": "batch"}


def protocol_settings(profile: str | None, epochs: int | None = None) -> dict:
    """The fine-tuning settings: the paper's (:data:`PAPER_PROTOCOL`) with the profile's ``finetune`` part on top.
    ``epochs`` (a command's ``--epochs``) replaces the profile's schedule: that many epochs, and no step floor
    (``min_steps`` 0), so ``--epochs 1`` is one epoch."""
    settings = dict(PAPER_PROTOCOL)
    if profile:
        settings.update(load_profile(profile).get("finetune", {}))
    floor = settings["min_steps"]
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
        raise ValueError(f"profile {profile!r}: finetune.min_steps={floor!r} must be a non-negative integer "
                         "(0 = no floor, the paper's protocol)")
    require_norm(f"profile {profile!r}: finetune", settings["norm"])
    if settings["device"] == "auto":
        settings["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if epochs:
        settings.update(epochs=int(epochs), min_steps=0)
    return settings


def site_folders(data_root: str) -> dict[str, str]:
    """``data_root/site-*`` folders (as written by ``fedssl fcl synth`` / ``fedssl fcl link-sites``), in site order."""
    return _site_folders(data_root, "run `fedssl fcl synth acdc` or `fedssl fcl link-sites`")


def load_labelled_sites(data_root: str, settings: dict) -> dict[str, list[Volume]]:
    return {
        site: load_site(path, with_labels=True, target_spacing=settings["target_spacing"],
                        image_size=settings["image_size"], site=site)
        for site, path in site_folders(data_root).items()
    }


def load_global_state(path: str) -> dict:
    """State dict of a FLARE global model file (PTFileModelPersistor format ``{"model": ...}``), of a site's
    ``fcl_client_state.pt`` (Local CL) or a plain state dict."""
    if not os.path.isfile(path):
        raise ValueError(f"pre-trained model {path} does not exist; pass the FL_global_model.pt of a pre-training run")
    data = safe_load(path)  # UnreadableFile (a ValueError) naming the file: truncated, not weights, a pickle payload
    if isinstance(data, dict) and "trainer" in data:  # a site's FCL checkpoint (Local CL: each site's own model)
        data = data["trainer"]
    state = data.get("model", data) if isinstance(data, dict) else None
    if not isinstance(state, dict) or not state:
        raise ValueError(f"{path} holds no state dict")
    try:
        return {str(k): torch.as_tensor(v) for k, v in state.items()}
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is not a state dict of tensors ({type(e).__name__}: {e})") from None


def encoder_init(path: str) -> dict:
    return encoder_state_from_global(load_global_state(path))


def export_unet_init(pretrained: str, out_path: str, features: Sequence[int], seed: int = 0) -> str:
    """A full U-Net checkpoint whose encoder is the pre-trained one (FLARE persistor format), for
    ``source_ckpt_file_full_name`` of the federated fine-tuning job; the decoder's initial weights from ``seed``.
    The U-Net has the pre-training's norm (read from the encoder: BatchNorm running statistics or none); the
    fine-tuning job's ``norm`` must be the same."""
    encoder = encoder_init(pretrained)
    unet = UNet2D(features, seed=seed, norm=state_norm(encoder))
    load_encoder_into_unet(unet, encoder)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    torch.save({"model": unet.state_dict()}, out_path)
    return out_path


def run_protocols(
    site_volumes: dict[str, list[Volume]],
    inits: dict[str, object],
    *,
    modes: Sequence[str],
    n_labelled: Sequence[int],
    folds: Sequence[int],
    settings: dict,
    progress=None,
    labelled_from: str = LABELLED_FROM[0],
) -> list[dict]:
    """The protocols of ``modes`` ("local", "centralised") for every init; ``labelled_from``: where the
    centralised protocol draws its N annotated patients (default "pooled": N in total, FCL Table 3)."""
    rows: list[dict] = []
    kw = dict(n_labelled=list(n_labelled), folds=list(folds), features=settings["features"], epochs=settings["epochs"],
              lr=settings["lr"], device=settings["device"], progress=progress,
              min_steps=settings["min_steps"], norm=settings["norm"])
    if "local" in modes:
        rows += local_finetune(site_volumes, inits, **kw)
    if "centralised" in modes:
        rows += centralised_finetune(site_volumes, inits, labelled_from=labelled_from, **kw)
    return rows


def evaluate_federated(global_model: str, site_volumes, *, method: str, n_labelled: int, fold: int,
                       settings: dict) -> list[dict]:
    unet = init_unet(load_global_state(global_model), features=settings["features"], norm=settings["norm"])
    return evaluate_per_site(unet, site_volumes, fold, method=method, n_labelled=n_labelled, device=settings["device"])


def run_finetune(data_root: str, init_paths: dict[str, str], out: str, *, modes: Sequence[str] = ("local",),
                 n_labelled: Sequence[int] = (1, 2, 4, 8), folds: Sequence[int] = (0, 1, 2, 3, 4),
                 profile: str | None = None, epochs: int | None = None, progress=None,
                 labelled_from: str = LABELLED_FROM[0]) -> list[dict]:
    """``fedssl fcl finetune``: the fine-tuning protocol of every init ``name -> FL_global_model.pt or "random"`` on
    the ``site-*`` folders of ``data_root`` (settings of ``profile``, ``epochs`` overriding its epochs;
    ``labelled_from`` of the centralised protocol, see :func:`fedssl.train.protocol.centralised_finetune`);
    writes the report to ``out`` and returns its rows."""
    if labelled_from not in LABELLED_FROM:  # refused before any file is read
        raise ValueError(f"labelled_from={labelled_from!r}: use one of {list(LABELLED_FROM)} (paper, Table 3: "
                         "'pooled')")
    from fedssl.eval.report import write_report

    settings = protocol_settings(profile, epochs)
    # the init files first: a bad one is refused before the sites' volumes are loaded
    inits = {name: "random" if path == "random" else encoder_init(path) for name, path in init_paths.items()}
    sites = load_labelled_sites(data_root, settings)
    rows = run_protocols(sites, inits, modes=modes, n_labelled=n_labelled, folds=folds, settings=settings,
                         progress=progress, labelled_from=labelled_from)
    write_report(rows, out, title="ACDC fine-tuning", extra={"settings": settings, "labelled_from": labelled_from})
    return rows
