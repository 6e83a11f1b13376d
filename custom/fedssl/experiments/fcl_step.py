"""``fedssl bench fcl-step``: where the time of one FCL pre-training step and one Table 1 fine-tuning step goes, on
the site's device, at the paper's model size (or the tiny one on a CPU).

For a trainer built as the FLARE executor builds it (:class:`fedssl.train.fcl.FCLLocalTrainer`, one synthetic
ACDC site of 10 patients x 10 frames), it times, after a warm-up round, each variant of the settings that decide
throughput (``workers`` DataLoader processes, ``amp`` bfloat16 autocast, ``channels_last``) over ``steps`` steps;
then the parts:

* ``data``: the site's batches alone (slice sampling, stacking, pinning, the copy to the device);
* ``compute``: the main encoder's forward and backward and the momentum encoder's forward on a random batch
  already on the device, with and without ``amp`` and ``channels_last`` (memory format of the weights and input);
* ``finetune``: one Table 1 fine-tuning step of the full U-Net (batch 10, Adam) the same way, and a real
  fine-tuning run (:func:`fedssl.train.segmentation.train_segmentation`) on one patient's ED and ES volumes.

Each figure is seconds per optimiser step, the mean over ``steps`` timed steps between device synchronisations.
Pure torch: no FLARE.  Writes ``fcl_step.json``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from fedssl.data.acdc import load_site
from fedssl.experiments.evidence import FCL_SIZES, _write_and_load_site, fcl_settings, pick_device
from fedssl.models.unet import MoCoUNetEncoder
from fedssl.train.fcl import FCLLocalTrainer
from fedssl.train.segmentation import init_unet, train_segmentation

VARIANTS = ({"workers": 0, "amp": True}, {"workers": 4, "amp": True}, {"workers": 0, "amp": False},
            {"workers": 0, "amp": True, "channels_last": True}, {"workers": 0, "amp": False, "channels_last": True})


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], steps: int, device: str, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _autocast(device: str, amp: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and device.startswith("cuda"))


def fcl_step_breakdown(out: str, *, size: str = "gpu", device: str = "auto", steps: int = 10,
                       variants=VARIANTS, say: Callable[[str], None] = print) -> dict:
    device = pick_device(device)
    cfg = FCL_SIZES[size]
    pre = cfg["pretrain"]
    root = os.path.join(out, "data", "acdc")
    data = dict(cfg["data"], n_patients=cfg["data"]["n_patients"] // cfg["data"]["n_sites"] * 2, n_sites=2)
    site, vols, _ = _write_and_load_site((root, "site-1", data, pre))
    result: dict = {"size": size, "device": device, "steps": steps, "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                    "trainer": [], "data": [], "compute": [], "finetune": []}
    base = fcl_settings(cfg, 0, device)
    for v in variants:
        s = replace(base, max_steps_per_round=steps, workers=v["workers"], amp=v["amp"] and device != "cpu",
                    channels_last=v.get("channels_last", False))
        tr = FCLLocalTrainer(vols, s, num_rounds=2, device=device, site=site)
        tr.train_round(0)
        _sync(device)
        t0 = time.perf_counter()
        stats = tr.train_round(1)
        _sync(device)
        row = dict(v, s_per_step=(time.perf_counter() - t0) / stats.steps)
        result["trainer"].append(row)
        say(f"FCL trainer {v}: {row['s_per_step'] * 1000:.1f} ms per step")
        if v is variants[0]:
            for w in (0, 4):
                it = tr.dataset.batches(tr.volumes_per_batch, 3, steps, workers=w, pin_memory=device != "cpu")
                _sync(device)
                t0 = time.perf_counter()
                n = 0
                for x, p in it:
                    x.to(device, non_blocking=True)
                    n += 1
                _sync(device)
                result["data"].append({"workers": w, "s_per_step": (time.perf_counter() - t0) / max(1, n)})
                say(f"data alone, workers {w}: {result['data'][-1]['s_per_step'] * 1000:.1f} ms per step")
        del tr
    batch = pre["batch_size"]
    px = pre["image_size"]
    for channels_last in (False, True):
        for amp in (False, True):
            net = MoCoUNetEncoder(tuple(pre["features"]), pre["proj_dim"], norm="batch", head="flatten",
                                  image_size=px).to(device)
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            net = net.to(memory_format=fmt)
            x = torch.rand(batch, 1, px, px, device=device).to(memory_format=fmt)
            opt = torch.optim.SGD(net.main.parameters(), lr=0.01, momentum=0.9)

            def step(net=net, x=x, opt=opt, amp=amp):
                with _autocast(device, amp):
                    q = net.main(x)
                    with torch.no_grad():
                        k = net.momentum(x)
                loss = (q.float() * k.float()).sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            row = {"channels_last": channels_last, "amp": amp and device != "cpu",
                   "s_per_step": _timed(step, steps, device)}
            result["compute"].append(row)
            say(f"FCL compute alone {row}")
            unet = init_unet("random", features=pre["features"], norm="batch").to(device).to(memory_format=fmt)
            xs = torch.rand(10, 1, px, px, device=device).to(memory_format=fmt)
            ys = torch.randint(0, 4, (10, px, px), device=device)
            uopt = torch.optim.Adam(unet.parameters(), lr=5e-4)

            def ustep(unet=unet, xs=xs, ys=ys, uopt=uopt, amp=amp):
                with _autocast(device, amp):
                    logits = unet(xs)
                loss = torch.nn.functional.cross_entropy(logits.float(), ys)
                uopt.zero_grad(set_to_none=True)
                loss.backward()
                uopt.step()

            row = {"channels_last": channels_last, "amp": amp and device != "cpu",
                   "s_per_step": _timed(ustep, steps, device)}
            result["finetune"].append(row)
            say(f"U-Net fine-tuning compute alone {row}")
            del net, unet, opt, uopt
    labelled = load_site(os.path.join(root, site), with_labels=True, site=site, target_spacing=pre["target_spacing"],
                         image_size=px)[:2]
    unet = init_unet("random", features=pre["features"], norm="batch")
    slices = sum(v.n_slices for v in labelled)
    epochs = 3
    _sync(device)
    t0 = time.perf_counter()
    train_segmentation(unet, labelled, epochs=epochs, batch_size=10, device=device)
    _sync(device)
    n_steps = epochs * -(-slices // 10)
    result["finetune_real"] = {"slices": slices, "steps": n_steps,
                               "s_per_step": (time.perf_counter() - t0) / n_steps}
    say(f"train_segmentation on 2 volumes: {result['finetune_real']['s_per_step'] * 1000:.1f} ms per step")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fcl_step.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return result
