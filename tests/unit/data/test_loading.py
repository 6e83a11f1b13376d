"""Batches from DataLoader worker processes are the batches built in the training process (issue 17 item 5)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fedssl.data import cxr, images
from fedssl.data.acdc import PartitionSampleDataset
from fedssl.data.cxr import ALL_CLASSES, CXRDataset, load_nih
from fedssl.data.cxr_synthetic import write_synthetic_nih
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import ImageDataset, load_image_records
from fedssl.data.loading import check_workers, collate, collate_labelled, load_batches
from fedssl.data.views import TwoViewDataset
from fedssl.data.volume import Volume
from fedssl.train.fedclf import view_batches

torch.set_num_threads(1)


def _same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for s, t in zip(x, y):
            assert s.dtype == t.dtype and torch.equal(s, t)


@pytest.fixture(scope="module")
def derm(tmp_path_factory):
    root = tmp_path_factory.mktemp("derm")
    write_synthetic_images(root, "derm", n_images=16, seed=0, image_size=24)
    return load_image_records(root, "derm", site="site-1")


def test_collate_stacks_tensors_and_makes_int_labels_long():
    items = [(torch.full((2,), float(i)), i, torch.tensor([i, -i])) for i in range(3)]
    x, y, z = collate(items)
    assert torch.equal(x, torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]))
    assert y.dtype == torch.long and y.tolist() == [0, 1, 2]
    assert z.tolist() == [[0, 0], [1, -1], [2, -2]]
    x, y = collate_labelled([(torch.zeros(1), torch.tensor(4)), (torch.ones(1), 5)])
    assert y.dtype == torch.long and y.tolist() == [4, 5] and x.shape == (2, 1)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_workers_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=r"argument workers=.*DataLoader worker processes"):
        check_workers(bad)
    with pytest.raises(ValueError, match="workers"):
        list(load_batches([(torch.zeros(1), 0)], [[0]], workers=bad))
    assert check_workers(0) == 0 and check_workers(3) == 3


def test_order_and_grouping_are_the_index_lists():
    data = [(torch.tensor([float(i)]), i) for i in range(7)]
    for workers in (0, 2):
        out = list(load_batches(data, [[6, 0], [3], [2, 5, 1]], workers=workers, collate_fn=collate_labelled))
        assert [b[1].tolist() for b in out] == [[6, 0], [3], [2, 5, 1]]
    assert list(load_batches(data, [], workers=2)) == []


class _Pid(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (torch.tensor(os.getpid()),)


def test_workers_build_the_batches_in_other_processes():
    here = {int(p) for (b,) in load_batches(_Pid(), [[0, 1], [2, 3]]) for p in b}
    there = {int(p) for (b,) in load_batches(_Pid(), [[0, 1], [2, 3]], workers=2) for p in b}
    assert here == {os.getpid()} and os.getpid() not in there and len(there) >= 1


def test_image_batches_from_workers_equal_in_process_and_warm_first(derm):
    ds = ImageDataset(derm, 16, "pretrain", "derm", site="site-1", seed=3)  # random crops, jitter, flips
    here = list(images.batches(ds, 5, seed=1, epoch=2))
    fresh = ImageDataset(derm, 16, "pretrain", "derm", site="site-1", seed=3)
    assert fresh.cached() == 0
    there = list(images.batches(fresh, 5, seed=1, epoch=2, workers=2))
    _same(here, there)
    assert fresh.cached() == len(derm)  # decoded once here, shared by the forked workers
    assert not torch.equal(here[0][0], list(images.batches(ds, 5, seed=1, epoch=3))[0][0])  # epochs differ


def test_two_view_batches_from_workers_equal_in_process(derm):
    ds = TwoViewDataset(derm, 16, "derm", site="site-1", seed=5)
    _same(list(view_batches(ds, 4, seed=2, epoch=1, max_steps=2)),
          list(view_batches(TwoViewDataset(derm, 16, "derm", site="site-1", seed=5), 4, seed=2, epoch=1,
                            max_steps=2, workers=2)))
    assert len(list(view_batches(ds, 4, seed=2, epoch=1, max_steps=2, workers=1))) == 2


def test_partition_batches_from_workers_equal_in_process():
    rng = np.random.default_rng(0)
    vols = [Volume(patient_id=f"patient{i:03d}", phase="frame01", image=rng.random((8, 6, 6), dtype=np.float32))
            for i in range(6)]
    ds = PartitionSampleDataset(vols, n_partitions=4, seed=7)
    here = list(ds.batches(2, epoch=1))
    _same(here, list(PartitionSampleDataset(vols, n_partitions=4, seed=7).batches(2, epoch=1, workers=2)))
    assert len(list(ds.batches(2, epoch=1, max_batches=2, workers=2))) == 2


def test_cxr_batches_from_workers_equal_in_process(tmp_path):
    write_synthetic_nih(tmp_path / "n", n_patients=3, seed=0, image_size=32)
    recs = load_nih(tmp_path / "n")
    make = lambda: CXRDataset(recs, ALL_CLASSES, image_size=32, train=True, seed=0)  # noqa: E731
    here = list(cxr.batches(make(), 3, seed=1, epoch=1))
    fresh = make()
    _same(here, list(cxr.batches(fresh, 3, seed=1, epoch=1, workers=2)))
    assert len(fresh._cache) == len(recs)  # warmed before the workers fork


def test_workers_leave_torch_global_generator_to_the_training_step():
    # dropout and drop-path draw from torch's global generator: batches from workers must not move it, or a run
    # with workers trains differently from one without (seen with FedDRA's text encoder)
    data = [(torch.tensor([float(i)]), i) for i in range(4)]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert len(list(load_batches(data, [[0, 1], [2, 3]], workers=1))) == 2
    assert torch.equal(torch.get_rng_state(), before)


class _WorkerDraws(torch.utils.data.Dataset):
    """Items drawn from a worker's global generators (what a hidden draw in a library would see)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        import random

        return (torch.tensor([float(torch.rand(())), float(np.random.rand()), random.random()]),)


def test_worker_seeds_follow_the_owned_rng_of_the_round():
    """Issue 42: a worker's torch / numpy / random seeds come from the loader's generator, seeded from the global
    generator's seed (the round's, inside fedssl.core.rng.owned_global_rng) without drawing from it."""
    from fedssl.core.rng import owned_global_rng

    def worker_draws(seed: int) -> torch.Tensor:
        with owned_global_rng(seed):
            return next(iter(load_batches(_WorkerDraws(), [[0, 1]], workers=1)))[0]

    first = worker_draws(3)
    assert torch.equal(worker_draws(3), first) and not torch.equal(worker_draws(4), first)


def test_a_corrupt_image_with_workers_names_the_file_and_the_site(tmp_path):
    from fedssl.data.images import ImageDataError

    write_synthetic_images(tmp_path, "derm", n_images=16, seed=0, image_size=24)
    recs = load_image_records(tmp_path, "derm", site="site-4")
    open(recs[5].path, "wb").write(b"not an image")
    ds = ImageDataset(recs, 16, "pretrain", "derm", site="site-4", seed=0)
    with pytest.raises(ImageDataError) as e:  # raised here (warm) or re-raised from a worker: type and message kept
        list(images.batches(ds, 4, seed=0, epoch=0, workers=2))
    assert "[site site-4]" in str(e.value) and recs[5].path in str(e.value)


def test_image_datasets_share_the_cache_base_and_warm_decodes_each_item_once(tmp_path, derm, monkeypatch):
    from fedssl.data.loading import CachedImageDataset
    from fedssl.data.vlp import VLPDataset, VLPRecord

    write_synthetic_nih(tmp_path / "n", n_patients=3, seed=0, image_size=32)
    cxr_ds = CXRDataset(load_nih(tmp_path / "n"), ALL_CLASSES, image_size=16, train=True, seed=0)
    vlp_ds = VLPDataset([VLPRecord(image=r.path, text="no finding", labels=(0,), patient=f"p{i}", study=f"s{i}",
                                   split="train")
                         for i, r in enumerate(derm)], 16, channels=3, colour="rgb")
    for ds, name in ((ImageDataset(derm, 16, "pretrain", "derm", site="site-1"), "raw"), (cxr_ds, "gray"),
                     (vlp_ds, "raw")):
        assert isinstance(ds, CachedImageDataset) and ds.cached() == 0
        calls = []
        real = getattr(ds, name)
        monkeypatch.setattr(ds, name, lambda i, real=real: calls.append(i) or real(i))
        ds.warm()
        ds.warm()  # the second pass finds every image in the cache
        assert ds.cached() == len(ds) > 0 and sorted(set(calls)) == list(range(len(ds)))
        ds.set_epoch(7)
        assert ds.epoch == 7
    off = ImageDataset(derm, 16, "pretrain", "derm", site="site-1", cache=False)
    off.warm()
    assert off.cached() == 0


def test_cache_base_without_decoded_cannot_be_built():
    from fedssl.data.loading import CachedImageDataset

    class Bare(CachedImageDataset):
        def __init__(self):
            self.records, self.cache, self.epoch, self._cache = [1, 2], True, 0, {}

    with pytest.raises(TypeError, match="Bare.*decoded"):  # refused at construction, not at the first warm()
        Bare()
