"""No raw data leaves a site: every upload of every job, scanned for the site's images and patches.

For each job under ``jobs/`` (quick profile, plus step caps that keep this short), the site's executor is built
from ``config_fed_client.json`` as FLARE builds it and driven in-process through one round of each of its
tasks, on synthetic data written by the data package: the server's initial global model (its ``model``
component) with the meta the job's workflows and filters add, and for Fed-BEiT the FederatedKMeans workflow
itself, whose broadcasts reach the sites' executors.  Every reply goes through the client's
``task_result_filters``; every numeric array in it (data, meta, headers, recursively) is then scanned by
:func:`tests.security.raw_data.leaks` for a row equal to one of the site's input images or patches.

The scan can fail: with the k-means suppression of small clusters disabled (a minimum cluster size of 1),
the Fed-BEiT k-means uploads are caught (``test_the_scan_catches_unsuppressed_kmeans_statistics``).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.experiments.job_data import JOB_DATA
from fedssl.core.surgical import classes_to_meta, slice_head_state
from fedssl.data.acdc import load_site
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.data.seg3d import list_items, load_volumes
from fedssl.data.cxr import CXRDataset, load_cxr_site
from fedssl.data.cxr_synthetic import write_synthetic_nih
from fedssl.data.fedclf_devices import build_devices
from fedssl.data.fedclf_synthetic import SOURCES, write_synthetic_derm_sources
from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import ImageDataset, load_image_records
from fedssl.flare.constants import (ALIGN_TASK, BACKBONE_KEY, CLASSES_KEY, DRO_ON_KEY, DRO_SITES_KEY, DRO_WEIGHT_KEY,
                                    GLOBAL_CLASSES_KEY, METHOD_KEY, MODE_KEY, SET_VOCAB_TASK, STAGE_KEY, VOCAB_KEY,
                                    WORD_COUNTS_KEY, WORD_COUNTS_TASK)
from fedssl.data.vlp import (VLPDataset, load_brset, load_manifest, load_messidor2, load_mimic_vlp,
                             write_client_manifests, write_source_manifests)
from fedssl.data.vlp_synthetic import write_synthetic_brset, write_synthetic_messidor2, write_synthetic_mimic
from fedssl.data.vocab import build_wordpiece_vocab
from fedssl.models.densenet import is_bn_key
from fedssl.models.vlp import ALIGNMENT_PREFIXES, VLP_PRESETS
from fedssl.ops.jobs import REPO_ROOT, build_job
from tests.security.raw_data import SiteData, leaks
from tests.unit.flare.fakes import FakeEngine, context

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
JOBS_DIR = os.path.join(REPO_ROOT, "jobs")
JOBS = sorted(d for d in os.listdir(JOBS_DIR) if os.path.isfile(os.path.join(JOBS_DIR, d, "meta.json")))
SITES = ["site-1", "site-2"]
#: the data set each job's sites read (fedssl.experiments.job_data), named as this module's fixture writes it: the
#: 3D job scans the ACDC volumes as its network sees them, surgical aggregation's site-1 is NIH
DATASET = {**{job: {"derm_devices": "derm5", "surgical": "cxr"}.get(kind, kind) for job, kind in JOB_DATA.items()},
           "acdc_seg3d": "acdc3d"}
#: data sets published only in SSL-FL's release layout: sites are cut from a release by the partitioner
RELEASES = ("covidfl", "derm_mel")
IMAGE_SETS = ("retina", "derm", *RELEASES)
#: on top of the quick profile: fewer steps (what is uploaded does not depend on how long a site trains)
SPEED = {"fcl_trainer": {"max_steps_per_round": 2}, "fedclf_trainer": {"max_steps_per_round": 2},
         "byol_trainer": {"max_steps_per_round": 2}, "seg_trainer": {"local_epochs": 1, "max_steps_per_epoch": 2},
         "seg3d_trainer": {"local_epochs": 1, "max_steps_per_epoch": 1}, "mim_trainer": {"max_steps_per_round": 2},
         "cls_trainer": {"max_steps_per_epoch": 2}, "feddra_trainer": {"align_steps": 1, "steps": 1},
         "cxr_trainer": {"local_epochs": 1, "max_steps_per_epoch": 1,
                                                                   "n_bootstrap": 0}}


# ---------------------------------------------------------------------------------------------- synthetic sites
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One folder per dataset with site folders site-1, site-2 (and the image datasets' test folder)."""
    root = tmp_path_factory.mktemp("sites")
    for i, site in enumerate(SITES):
        for dataset in ("retina", "derm"):
            write_synthetic_images(root / dataset / site, dataset, n_images=24, seed=i, image_size=40)
        write_synthetic_nih(root / "cxr" / site, n_patients=10, seed=i, image_size=32)
    for dataset in ("retina", "derm"):
        write_synthetic_images(root / dataset / "test", dataset, n_images=16, seed=9, image_size=40)
    for dataset in RELEASES:  # release layout -> site-1, site-2 (class folders) + test, as `fedssl sslfl partition`
        write_synthetic_images(root / f"{dataset}_release", dataset, n_images=60, seed=0, image_size=40)
        write_site_folders(root / f"{dataset}_release", dataset, root / dataset, n_sites=len(SITES),
                           release_split="", seed=0)
    write_synthetic_acdc(root / "acdc", n_patients=5, n_sites=1, seed=0, shape=(48, 48), n_frames=3,
                         slices_range=(4, 5))
    os.symlink(root / "acdc", root / "acdc3d")  # the same sites, read by the 3D pipeline
    # FedCLF devices (site-1 ... site-10, each with train / val / test class folders)
    write_synthetic_derm_sources(str(root / "derm5_raw"), n_isic=200, seed=0, image_size=40)
    build_devices(str(root / "derm5"), *(str(root / "derm5_raw" / s) for s in SOURCES), seed=0, short_edge=36)
    # FedDRA: synthetic MIMIC-CXR cut into two LDA clients; MESSIDOR-2 and BRSET as one client each
    write_synthetic_mimic(str(root / "vlp_mimic_raw"), n_patients=40, image_px=32, seed=0)
    write_client_manifests(load_mimic_vlp(str(root / "vlp_mimic_raw"), site="raw")[0], str(root / "vlp_mimic"),
                           n_clients=len(SITES), alpha=1.0, seed=0, min_per_client=5)
    write_synthetic_messidor2(str(root / "vlp_retina_raw" / "messidor2"), n_images=24, image_px=32, seed=0)
    write_synthetic_brset(str(root / "vlp_retina_raw" / "brset"), n_images=24, image_px=32, seed=1)
    write_source_manifests({"site-1": load_messidor2(str(root / "vlp_retina_raw" / "messidor2"), site="site-1")[0],
                            "site-2": load_brset(str(root / "vlp_retina_raw" / "brset"), site="site-2")[0]},
                           str(root / "vlp_retina"))
    return root


def site_data(kind: str, root: Path, site: str, args: dict) -> SiteData:
    """What ``site`` holds, as :class:`SiteData` (the executor's input views and the files as stored)."""
    out = SiteData(site)
    folder = root / kind / site
    if kind in IMAGE_SETS:
        for sub in (folder, root / kind / "test"):
            ds = ImageDataset(load_image_records(str(sub), kind, site=site), args["image_size"], "eval", kind)
            out.add_images(torch.stack([ds[i][0] for i in range(len(ds))]), args["patch_size"])
            out.add_files(str(sub))
    elif kind == "derm5":  # a FedCLF device: its three splits
        for split in ("train", "val", "test"):
            ds = ImageDataset(load_image_records(str(folder / split), kind, site=site), args["image_size"], "eval",
                              kind)
            out.add_images(torch.stack([ds[i][0] for i in range(len(ds))]))
        out.add_files(str(folder))
    elif kind.startswith("vlp_"):  # a FedDRA site: its manifest's images, as the model sees them and as stored
        recs = load_manifest(str(folder / "manifest.csv"), None, site=site)
        ds = VLPDataset(recs, args["image_size"], channels=3, colour=args["colour"], site=site)
        out.add_images(torch.stack([ds[i][0] for i in range(len(ds))]), VLP_PRESETS[args["preset"]]["patch_size"])
        for r in recs:
            out.add_files(os.path.dirname(r.image))
    elif kind == "acdc3d":  # the volumes as the 3D network sees them (resampled, scaled), slice by slice, and the files
        vols = load_volumes(list_items("acdc", str(folder), site), "acdc", args["pixdim"], args["roi_size"], site)
        out.add_images(torch.cat([v["image"][0].permute(2, 0, 1)[:, None] for v in vols]))
        out.add_files(str(folder))
    elif kind == "acdc":
        for frames in ("ed_es", "all"):
            vols = load_site(str(folder), with_labels=False, target_spacing=args["target_spacing"],
                             image_size=args["image_size"], frames=frames, site=site)
            out.add_images(torch.from_numpy(np.concatenate([v.image for v in vols]))[:, None])
        out.add_files(str(folder))
    else:
        classes = args["classes"][site]
        ds = CXRDataset(load_cxr_site(str(folder), args["dataset"][site], site=site), classes,
                        image_size=args["image_size"], train=False, site=site)
        out.add_images(torch.stack([ds[i][0] for i in range(len(ds))]))
        out.add_files(str(folder))
    return out.freeze()


# ---------------------------------------------------------------------------------------------- a job, site side
def instantiate(spec: dict):
    module, _, name = spec["path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("args", {}))


class SiteRun:
    """A job built with the quick profile; its client executor per site, driven in-process, uploads recorded."""

    def __init__(self, job: str, root: Path, out: Path):
        with open(os.path.join(JOBS_DIR, job, "app", "config", "config_fed_client.json")) as f:
            exec_id = json.load(f)["executors"][0]["executor"]["id"]
        sets = [f"client.{exec_id}.data_root={root / DATASET[job]}/{{site}}"]
        sets += [f"client.{exec_id}.{k}={json.dumps(v)}" for k, v in SPEED.get(exec_id, {}).items()]
        job_dir = build_job(os.path.join(JOBS_DIR, job), str(out / "job"), profile="quick", sets=sets,
                            n_sites=len(SITES))
        with open(os.path.join(job_dir, "app", "config", "config_fed_client.json")) as f:
            self.client = json.load(f)
        with open(os.path.join(job_dir, "app", "config", "config_fed_server.json")) as f:
            self.server = json.load(f)
        self.spec = self.client["executors"][0]["executor"]
        self.executors = {site: instantiate(self.spec) for site in SITES}
        self.filters = [(set(group["tasks"]), [instantiate(f) for f in group["filters"]])
                        for group in self.client.get("task_result_filters", [])]
        self.out, self.uploads = out, {site: [] for site in SITES}

    @property
    def args(self) -> dict:
        return self.spec["args"]

    def component(self, comp_id: str) -> dict:
        found = [c for c in self.server.get("components", []) + self.server.get("workflows", []) if c["id"] == comp_id]
        return found[0]

    def global_weights(self) -> dict[str, np.ndarray]:
        """The server's initial global model: its ``model`` component, as the persistor loads it."""
        return {k: v.numpy() for k, v in instantiate(self.component("model")).state_dict().items()}

    def num_rounds(self) -> int:
        return int(self.component("scatter_and_gather")["args"]["num_rounds"])

    def context(self, site: str):
        run_dir = self.out / "run" / site
        run_dir.mkdir(parents=True, exist_ok=True)
        return context(site=site, engine=FakeEngine(run_dir))

    def send(self, site: str, task: str, shareable, executor=None):
        """One task at ``site``: the executor's reply after the client's result filters (what leaves the site)."""
        ctx = self.context(site)
        reply = (executor or self.executors[site]).execute(task, shareable, ctx, Signal())
        assert reply.get_return_code() in (None, ReturnCode.OK), f"{site}: {task} failed (see the log)"
        for tasks, filters in self.filters:
            if task in tasks:
                for f in filters:
                    reply = f.process(reply, ctx)
        self.uploads[site].append((f"{task}:", reply))
        return reply


def weights_task(weights: dict, meta: dict | None = None, round_idx: int = 0, num_rounds: int = 3):
    s = DXO(DataKind.WEIGHTS, data=weights, meta=meta or {}).to_shareable()
    s.set_header(AppConstants.CURRENT_ROUND, round_idx)
    s.set_header(AppConstants.NUM_ROUNDS, num_rounds)
    return s


# ---------------------------------------------------------------------------------------------- one round per job
def train_round(run: SiteRun, site: str = "site-1") -> None:
    run.send(site, "train", weights_task(run.global_weights(), num_rounds=run.num_rounds()))


def classifier_round(run: SiteRun, site: str = "site-1") -> None:
    """train, then FinalEvaluation's test task (the fine-tuned model: here the site's own, meta ``model_source``)."""
    trained = from_shareable(run.send(site, "train", weights_task(run.global_weights(), num_rounds=run.num_rounds())))
    run.send(site, "test", weights_task(trained.data, {"model_source": "best"}))


def fclopt_round(run: SiteRun, site: str = "site-1") -> None:
    """FCLOptController: train with the run's mode; PTNU-DP's report_distance (online network only) at a site
    starting a ptnu_dp run."""
    mode = run.component("scatter_and_gather")["args"]["mode"]
    weights = run.global_weights()
    run.send(site, "train", weights_task(weights, {MODE_KEY: mode}, num_rounds=run.num_rounds()))
    online = {k: v for k, v in weights.items() if not k.startswith("target.")}
    # a second executor (a fresh site state): report_distance opens a ptnu_dp run, before its first train task
    run.send(site, "report_distance", weights_task(online, {MODE_KEY: "ptnu_dp"}), executor=instantiate(run.spec))


def surgical_round(run: SiteRun, site: str = "site-1") -> None:
    """ClassRegistration's declare_classes, a train task as BackboneBNExclusion + HeadSlicer send it (batch-norm
    kept local, head cut to the site's classes), and SurgicalEvaluation's test task (the whole head)."""
    reg = run.component("class_registration")["args"]
    switches = {METHOD_KEY: reg["method"], BACKBONE_KEY: reg["backbone"]}
    run.send(site, "declare_classes", DXO(DataKind.METRICS, data={}, meta=switches).to_shareable())
    network = run.component("model")["args"]["classes"]
    mine = run.args["classes"][site]
    weights = {k: v for k, v in run.global_weights().items() if reg["backbone"] == "fedavg" or not is_bn_key(k)}
    meta = {**switches, CLASSES_KEY: classes_to_meta(mine)}
    run.send(site, "train", weights_task(slice_head_state(weights, network, mine, site), meta,
                                         num_rounds=run.num_rounds()))
    run.send(site, "test", weights_task(weights, {**meta, GLOBAL_CLASSES_KEY: classes_to_meta(network)}, 1))


def beit_round(run: SiteRun, site: str = "site-1") -> None:
    """The FederatedKMeans workflow of the job, its broadcasts answered by both sites' executors, then train."""
    ctrl = instantiate(run.component("federated_kmeans"))

    def broadcast(task, fl_ctx, min_responses, wait_time_after_min_received, abort_signal):
        for s in SITES:
            ct = ClientTask(Client(s, None), task)
            ct.result = run.send(s, task.name, task.data)
            task.client_tasks.append(ct)

    class Engine(FakeEngine):
        def get_clients(self):
            return [Client(s, None) for s in SITES]

    ctrl.broadcast_and_wait = broadcast
    ctrl.fire_event = lambda event_type, fl_ctx: None
    server = context(site="server", engine=Engine(run.out / "server"))
    ctrl.start_controller(server)
    ctrl.control_flow(Signal(), server)
    assert len(ctrl.history) == ctrl.n_iters and all(h["sites"] == len(SITES) for h in ctrl.history)
    train_round(run, site)


def feddra_round(run: SiteRun, site: str = "site-1") -> None:
    """The vocabulary exchange (word counts up, the vocabulary down), stage 1 and stage 2 of a DRO turn (the site's
    weight as DROWeightFilter sends it), FinalEvaluation's test task; no upload may hold a report, a sentence, or
    a word seen in fewer reports than the threshold."""
    counts = from_shareable(run.send(site, WORD_COUNTS_TASK, DXO(DataKind.METRICS, data={}).to_shareable())).data
    counts = counts[WORD_COUNTS_KEY]
    vocab = build_wordpiece_vocab(counts, run.args["vocab_size"])
    run.send(site, SET_VOCAB_TASK, DXO(DataKind.METRICS, data={}, meta={VOCAB_KEY: vocab}).to_shareable())
    weights = run.global_weights()
    dro = {DRO_ON_KEY: True, DRO_WEIGHT_KEY: 0.5, DRO_SITES_KEY: len(SITES)}
    rounds = run.num_rounds()
    run.send(site, ALIGN_TASK, weights_task(weights, {STAGE_KEY: "align", **dro}, num_rounds=rounds))
    aligned = {k: v for k, v in weights.items() if k.startswith(ALIGNMENT_PREFIXES)}
    run.send(site, "train", weights_task(aligned, {STAGE_KEY: "full_model", **dro}, num_rounds=rounds))
    run.send(site, "test", weights_task(weights, {"model_source": "last"}))
    texts = [r.text.lower() for r in load_manifest(str(Path(run.args["data_root"].replace("{site}", site))
                                                           / "manifest.csv"), None, site=site)]
    sent = json.dumps([{k: v for k, v in from_shareable(reply).get_meta_props().items()
                        if isinstance(v, (str, dict, list))}
                       for _, reply in run.uploads[site]] + [counts], default=str).lower()
    assert not any(t in sent for t in texts)  # no report / caption
    floor = max(run.args["min_word_count"], 1)
    assert all(sum(w in t for t in texts) >= floor for w in counts)  # only words in >= min_word_count reports


ROUNDS = {"fcl_acdc": train_round, "fcl_acdc_finetune": train_round, "fclopt_acdc": fclopt_round,
          "fedmae_derm": train_round, "fedmae_derm_finetune": classifier_round, "sslfl_beit_retina": beit_round,
          "sslfl_mae_retina": train_round, "sslfl_retina_finetune": classifier_round, "surgical_cxr": surgical_round,
          "sslfl_mae_covidfl": train_round, "sslfl_covidfl_finetune": classifier_round, "sslfl_mae_derm": train_round,
          "sslfl_derm_finetune": classifier_round, "fedclf_derm": train_round, "fedclf_derm_finetune": classifier_round,
          "feddra_mimic": feddra_round, "feddra_retina": feddra_round, "acdc_seg3d": classifier_round}


def scanned(job: str, data: Path, tmp_path: Path) -> tuple[SiteRun, dict[str, list[str]]]:
    run = SiteRun(job, data, tmp_path)
    ROUNDS[job](run)
    found = {}
    for site, uploads in run.uploads.items():
        if uploads:
            held = site_data(DATASET[job], data, site, run.args)
            assert held.n_rows > 20, f"{site}: too little site data to scan for"
            found[site] = leaks(uploads, held)
    return run, found


def test_every_job_has_a_round():
    assert set(ROUNDS) == set(JOBS) and set(DATASET) == set(JOBS)


@pytest.mark.parametrize("job", JOBS)
def test_no_upload_holds_an_input_image_or_patch(job, data, tmp_path):
    run, found = scanned(job, data, tmp_path)
    tasks = {name for uploads in run.uploads.values() for name, _ in uploads}
    client_tasks = {t for e in run.client["executors"] for t in e["tasks"]}
    assert {t.rstrip(":") for t in tasks} == client_tasks  # one round of every task the site runs
    assert found and all(hits == [] for hits in found.values()), {s: h[:5] for s, h in found.items()}


def test_the_scan_catches_unsuppressed_kmeans_statistics(data, tmp_path, monkeypatch):
    """With the site's suppression of small clusters disabled (min cluster size 1), the Fed-BEiT k-means
    statistics hold single patch vectors, and the scan finds them."""
    import fedssl.train.mim as site_side
    from fedssl.core import tokenizer

    monkeypatch.setattr(site_side, "suppress_small_clusters", lambda sums, counts, m: (sums, counts))
    monkeypatch.setattr(site_side, "site_kmeans_stats",
                        lambda x, codebook, m: tokenizer.site_kmeans_stats(x, codebook, 1))
    monkeypatch.setattr("fedssl.flare.federated_kmeans.FederatedKMeans._counts",
                        lambda self, dxo, site, task, n: np.asarray(dxo.data["counts"], dtype=np.int64))
    _, found = scanned("sslfl_beit_retina", data, tmp_path)
    # both k-means answers leak at both sites: the local cluster means (init) and the E-step sums (step)
    assert {site: sorted({h.split(":")[0] for h in hits}) for site, hits in found.items()} == {
        s: ["kmeans_init", "kmeans_step"] for s in SITES}
