"""SSL-FL's pooled control: the pooled site folder, the settings read from the fine-tuning job, MAE's untrained
init, the paired lines by hand, and one tiny resumed run of the three arms."""

import json
import os

import pytest
import torch

from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.experiments import sslfl_control as sc
from fedssl.models.vit import MAEViT


def _site(root, name, rows):
    os.makedirs(os.path.join(root, name, "train"), exist_ok=True)
    with open(os.path.join(root, name, "trainLabels.csv"), "w") as f:
        f.write("image,level\n" + "".join(f"{img},{lvl}\n" for img, lvl in rows))
    for img, _ in rows:
        open(os.path.join(root, name, "train", img + ".jpeg"), "w").close()


def test_the_pooled_site_holds_every_sites_images_and_labels_in_site_order(tmp_path):
    split = tmp_path / "split3"
    _site(split, "site-2", [("c", 0)])
    _site(split, "site-1", [("a", 1), ("b", 0)])
    pool = sc.pooled_site(str(split), str(tmp_path / "work"))
    assert open(os.path.join(pool, "trainLabels.csv")).read() == "image,level\na,1\nb,0\nc,0\n"
    assert sorted(os.listdir(os.path.join(pool, "train"))) == ["a.jpeg", "b.jpeg", "c.jpeg"]
    assert os.path.realpath(os.path.join(pool, "train", "c.jpeg")) == str(split / "site-2" / "train" / "c.jpeg")
    assert sc.pooled_site(str(split), str(tmp_path / "work")) == pool  # a re-run keeps the links
    with pytest.raises(ValueError, match="run `fedssl sslfl tables`"):
        sc.pooled_site(str(tmp_path / "work" / "train"), str(tmp_path / "w2"))


def test_the_settings_are_the_fine_tuning_jobs_at_the_profile():
    bench = sc.control_settings("bench", epochs=40, seed=2)
    assert (bench["lr"], bench["batch_size"], bench["warmup"], bench["val_fraction"]) == (0.003, 32, 5, 0.2)
    assert (bench["image_size"], bench["patch_size"], bench["embed_dim"], bench["depth"]) == (32, 4, 48, 2)
    assert (bench["layer_decay"], bench["weight_decay"], bench["min_lr"]) == (0.65, 0.05, 1e-6)
    assert (bench["epochs"], bench["seed"], bench["drop_path_rate"]) == (40, 2, 0.0)
    assert (sc.control_settings("bench64", 3, 0)["image_size"], sc.control_settings("bench64", 3, 0)["warmup"]) == (
        64, 3)
    with pytest.raises(ValueError, match="epochs"):
        sc.control_settings("bench", epochs=0, seed=0)


def test_maes_untrained_init_is_the_pretraining_jobs_model_at_the_seed(tmp_path):
    args = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, decoder_embed_dim=32,
                decoder_depth=1, decoder_num_heads=2, norm_pix_loss=True)
    trained = {k: v + 1.0 for k, v in MAEViT(**args, seed=5).state_dict().items()}
    like = tmp_path / "FL_global_model.pt"
    torch.save({"model": trained, "train_conf": {"train": {"model": "x"}}}, like)
    out = sc.mae_init_model("quick", 5, str(like), str(tmp_path / "init.pt"))
    saved = torch.load(out, weights_only=True)
    fresh = MAEViT(**args, seed=5).state_dict()
    assert saved["train_conf"] == {"train": {"model": "x"}} and set(saved["model"]) == set(fresh)
    assert all(torch.equal(saved["model"][k], fresh[k]) for k in fresh)
    qkv = saved["model"]["encoder.blocks.0.attn.qkv.weight"]  # xavier-uniform (144, 48): std sqrt(2 / 192)
    assert float(qkv.std()) == pytest.approx((2 / 192) ** 0.5, rel=0.1)
    torch.save({"model": {"other": torch.zeros(1)}}, like)
    with pytest.raises(ValueError, match="keys differ"):
        sc.mae_init_model("quick", 5, str(like), str(tmp_path / "init.pt"))


def test_paired_lines_by_hand():
    acc = {("fedmae", 0): 0.50, ("scratch", 0): 0.70, ("fedmae", 1): 0.80, ("scratch", 1): 0.70, ("mae_init", 1): 0.9}
    rows = [{"arm": a, "seed": s, "test_accuracy": v} for (a, s), v in acc.items()]
    lines = sc.paired_lines(rows)
    # differences -20 and +10 points: mean -5, sample std 21.21, SE 15.00
    assert lines[0] == "fedmae minus scratch: -5.00 points (SE 15.00 over 2 seeds; per seed -20.00 / +10.00)"
    assert lines[1] == "fedmae minus mae_init: -10.00 points (one seed; per seed -10.00)"
    assert lines[2] == "mae_init minus scratch: +20.00 points (one seed; per seed +20.00)"
    assert sc.paired_lines(rows[:1]) == []


def test_a_tiny_run_of_the_three_arms_resumes(tmp_path):
    out = tmp_path / "table"
    split = out / "data" / "seed0" / "split3"
    src = tmp_path / "src"
    write_synthetic_images(str(src), "retina", 16, seed=0, image_size=40)
    rows = open(src / "trainLabels.csv").read().splitlines()[1:]
    for i, name in enumerate(("site-1", "site-2", "test")):
        part = [r.split(",") for r in rows[i::3]]
        _site(split, name, [(img, 1 if int(lvl) > 0 else 0) for img, lvl in part])
        for img, _ in part:
            os.replace(src / "train" / (img + ".jpeg"), split / name / "train" / (img + ".jpeg"))
    like = tmp_path / "FL_global_model.pt"
    torch.save({"model": {k: v + 0.01 for k, v in MAEViT(image_size=32, patch_size=4, embed_dim=48, depth=2,
                                                           num_heads=3, decoder_embed_dim=32, decoder_depth=1,
                                                           decoder_num_heads=2, norm_pix_loss=True,
                                                           seed=0).state_dict().items()}}, like)
    with pytest.raises(ValueError, match="no Fed-MAE pre-training of split 3"):
        sc.run_control(str(out), "quick", 3, [0], epochs=1)
    with open(out / "cells.jsonl", "w") as f:
        f.write(json.dumps({"key": {"stage": "pretrain", "method": "fedmae", "split": 3, "seed": 0},
                            "result": {"global_model": str(like)}, "seconds": 1.0}) + "\n")
    said = []
    first = sc.run_control(str(out), "quick", 3, [0], epochs=1, say=said.append)
    assert [r["arm"] for r in first] == ["scratch", "fedmae", "mae_init"] and len(said) == 3
    assert all(0.0 <= r["test_accuracy"] <= 1.0 and r["threads"] == 1 for r in first)
    assert os.path.isfile(out / "control" / "seed0" / "mae_init.pt")
    with open(out / "control.jsonl") as f:
        assert len(f.readlines()) == 3
    again = sc.run_control(str(out), "quick", 3, [0], epochs=1)  # resumed: nothing runs, the same rows
    assert again == first
    with open(out / "control.jsonl") as f:
        assert len(f.readlines()) == 3
