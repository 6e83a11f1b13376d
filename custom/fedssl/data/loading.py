"""Mini-batches of a site's dataset, in the training process or in DataLoader worker processes.

Every augmented dataset of the bundle draws the randomness of item ``i`` in epoch ``e`` from
``(seed, e, i)`` only, and every batch function fixes the order of an epoch from ``(seed, epoch)``. So the
batches do not depend on which process builds them: ``workers=0`` builds them here, one after the other;
``workers > 0`` hands the same index lists to a :class:`torch.utils.data.DataLoader` with that many worker
processes, which decode and augment the next batches while the accelerator trains on this one, and yields
exactly the same tensors. ``pin_memory`` puts each batch in page-locked memory, so that a later
``.to("cuda", non_blocking=True)`` overlaps the copy with compute; trainers turn it on only for a CUDA device.

A dataset with a ``warm()`` method (the image datasets: decode and cache every image) is warmed in this
process before the workers start, so forked workers share the decoded images instead of decoding them again
every epoch.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from fedssl.core.checks import require_workers


class CachedImageDataset(Dataset, abc.ABC):
    """Base of the image datasets: ``self.records`` (one per item), ``self.epoch`` (item ``i``'s augmentation draws
    from ``(seed, epoch, i)``; set with :meth:`set_epoch`) and ``self._cache`` (index -> decoded uint8 image, kept
    when ``self.cache`` is true).  A subclass sets those three and ``cache`` in its constructor and implements
    :meth:`decoded`."""

    records: list
    cache: bool
    epoch: int
    _cache: dict

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @abc.abstractmethod
    def decoded(self, index: int):
        """The decoded (not augmented) image of item ``index``, cached when ``cache`` is true."""

    def warm(self) -> None:
        """Decode and cache every image now (``cache=True``), e.g. before DataLoader workers fork."""
        if self.cache:
            for i in range(len(self)):
                self.decoded(i)

    def cached(self) -> int:
        """Number of decoded images held in memory."""
        return len(self._cache)


def check_workers(workers: object, name: str = "load_batches") -> int:
    """``workers`` is a non-negative int (0 = build batches in the training process); returns it."""
    require_workers(name, workers)
    return int(workers)


def loader_options(workers: int, device: torch.device | str) -> dict[str, Any]:
    """The ``workers`` / ``pin_memory`` arguments of the batch functions for a trainer on ``device``: batches are
    pinned only for a CUDA device (page-locked memory speeds up host-to-GPU copies and nothing else)."""
    return {"workers": workers, "pin_memory": torch.device(device).type == "cuda"}


def collate(items: Sequence[tuple]) -> tuple:
    """Stack a list of equal-length item tuples field by field: tensors with ``torch.stack``, Python ints
    (class labels) into one LongTensor, strings (report texts) into a list."""
    out: list[Any] = []
    for field in zip(*items):
        if isinstance(field[0], torch.Tensor):
            out.append(torch.stack(list(field)))
        elif isinstance(field[0], str):
            out.append(list(field))
        else:
            out.append(torch.tensor([int(v) for v in field], dtype=torch.long))
    return tuple(out)


def collate_labelled(items: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [B, ...], y LongTensor [B])`` from ``(x, label)`` items whose label is an int or a 0-d tensor."""
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items], dtype=torch.long)


def _pinned(batch: tuple) -> tuple:
    return tuple(t.pin_memory() if isinstance(t, torch.Tensor) else t for t in batch)


def load_batches(dataset: Dataset, index_batches: Sequence[Sequence[int]], *, workers: int = 0,
                 pin_memory: bool = False, collate_fn: Callable[[Sequence[tuple]], tuple] = collate) -> Iterator[tuple]:
    """Yield ``collate_fn([dataset[i] for i in b])`` for each index list ``b``, in order.

    ``workers``: 0 = here, one batch at a time (nothing is built before it is asked for); > 0 = that many
    DataLoader worker processes, same batches. ``pin_memory``: page-locked batches (use only with CUDA).
    Call the dataset's ``set_epoch`` before this: workers copy the dataset when the iteration starts.
    """
    workers = check_workers(workers)
    index_batches = [[int(i) for i in b] for b in index_batches]
    if not index_batches:
        return
    if workers == 0:
        for b in index_batches:
            batch = collate_fn([dataset[i] for i in b])
            yield _pinned(batch) if pin_memory else batch
        return
    warm = getattr(dataset, "warm", None)
    if callable(warm):
        warm()
    # the loader's own generator: its worker base seed must not draw from torch's global generator, which the
    # training step's dropout uses (the items' randomness comes from (seed, epoch, index), not from worker seeds).
    # It is seeded from the global generator's seed without drawing from it: inside a trainer's owned global RNG
    # (fedssl.core.rng) that is the round's seed, so each worker's torch / numpy / random seeds (which torch derives
    # from the base seed) are the round's too, and workers=0 and workers>0 leave the same draws to the dropout
    loader = DataLoader(dataset, batch_sampler=index_batches, collate_fn=collate_fn, num_workers=workers,
                        pin_memory=pin_memory, persistent_workers=False,
                        generator=torch.Generator().manual_seed(torch.initial_seed()))
    yield from loader
