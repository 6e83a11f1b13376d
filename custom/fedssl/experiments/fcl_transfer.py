"""``fedssl fcl transfer``: FCL Table 5 (ACDC -> HVSMR) from files: the HVSMR folder, the pre-trained models, a report.

The protocol itself is :func:`fedssl.train.transfer.transfer_finetune`; this module reads its inputs (the HVSMR
layout of :mod:`fedssl.data.hvsmr`, an ACDC pre-training job's ``FL_global_model.pt`` or the U-Net of
``fedssl fcl export-unet``) and writes ``summary.json`` and ``dice_table.txt``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from fedssl.data.hvsmr import load_hvsmr
from fedssl.eval.report import format_table
from fedssl.experiments.fcl_finetune import load_global_state
from fedssl.models.unet import ENCODER_MODULES, ENCODER_PREFIXES, encoder_state_from_global
from fedssl.train.transfer import PAPER_TRANSFER, summarise_transfer, transfer_finetune


def transfer_encoder(path: str) -> dict:
    """The ACDC pre-trained encoder in ``path``: cut out of a pre-training global model (MoCo main / BYOL online
    encoder), or the encoder part of a full U-Net (``fedssl fcl export-unet``); only the encoder transfers, since
    HVSMR's output layer has 3 classes, ACDC's 4."""
    state = load_global_state(path)
    if any(k.startswith(ENCODER_PREFIXES) for k in state):
        return encoder_state_from_global(state)
    encoder = {k: v for k, v in state.items() if k.split(".", 1)[0] in ENCODER_MODULES}
    if not encoder:
        raise ValueError(f"{path} holds neither a pre-training global model ({' / '.join(ENCODER_PREFIXES)}*) nor a "
                         f"U-Net ({', '.join(ENCODER_MODULES)}); pass an ACDC pre-training run's FL_global_model.pt")
    return encoder


def run_transfer(data_root: str, init_paths: dict[str, str], out: str, *, settings: dict[str, Any],
                 variant: str = "axial_crop", image_size: int = 192, seed: int = 0, progress=None) -> list[dict]:
    """Table 5 for every init ``name -> path | "random"`` on the HVSMR folder ``data_root``; ``settings`` overrides
    :data:`fedssl.train.transfer.PAPER_TRANSFER` (features, norm, epochs, lr, n_labelled, folds, target_spacing,
    device).
    The inits are read first, so a bad file is refused before the volumes are loaded.  Writes the report to
    ``out`` and returns its rows."""
    s = {**PAPER_TRANSFER, "device": "cpu", **settings}
    inits = {name: "random" if path == "random" else transfer_encoder(path) for name, path in init_paths.items()}
    volumes = load_hvsmr(data_root, variant=variant, target_spacing=s["target_spacing"], image_size=image_size)
    rows = transfer_finetune(volumes, inits, n_labelled=s["n_labelled"], folds=s["folds"], features=s["features"],
                             epochs=s["epochs"], batch_size=s["batch_size"], lr=s["lr"], seed=seed,
                             device=s["device"], n_folds=s["n_folds"], progress=progress, norm=s["norm"])
    write_transfer_report(rows, out, extra={"settings": s, "variant": variant, "image_size": image_size,
                                            "seed": seed, "inits": init_paths})
    return rows


def write_transfer_report(rows: Sequence[dict], out: str, *, extra: dict) -> dict[str, str]:
    """``summary.json`` (rows, Table 5 cells, settings) and ``dice_table.txt`` (mean Dice, then each class)."""
    os.makedirs(out, exist_ok=True)
    summary = summarise_transfer(rows)
    paths = {"summary_json": os.path.join(out, "summary.json"), "dice_table": os.path.join(out, "dice_table.txt")}
    with open(paths["summary_json"], "w") as f:
        json.dump({"title": "FCL Table 5: transfer ACDC -> HVSMR", "rows": list(rows), "summary": summary,
                   "extra": extra}, f, indent=2)
    tables = [f"{key}\n"
              f"{format_table([{**c, 'dice_mean': c[f'{key}_mean'], 'dice_std': c[f'{key}_std']} for c in summary])}"
              for key in ("dice", "myocardium", "blood_pool")]
    with open(paths["dice_table"], "w") as f:
        f.write("FCL Table 5: transfer ACDC -> HVSMR (mean +- std over folds)\n\n" + "\n".join(tables))
    return paths
