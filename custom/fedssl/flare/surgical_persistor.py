"""PyTorch persistor whose global head has one row per class of the network, learnt at registration.

The server's model component is a class-name-bound DenseNet (``classes``: rows of ``classifier``).  The
network's classes ``C`` are only known once every site has declared its own (ClassRegistration, before
ScatterAndGather loads the model), so when ScatterAndGather asks for the initial model this persistor
rebuilds the head over ``C``, by name: a class of the model component keeps its row, a class new to it
gets a seeded fresh row (uniform in +-1/sqrt(F), bias 0; the same init on every run with the same seed).
A source checkpoint's head is read in the order of the model component's ``classes``.  The saved
``FL_global_model.pt`` / ``best_FL_global_model.pt`` carry the head over ``C``; ``classes.json`` in the
server run folder names its rows.

Initial weights (issue 13 item 2; paper sec. 2.5 "ImageNet-pretrained DenseNet121"): at START_RUN, before any
workflow logs, the persistor states which initial weights the run starts from and publishes them as the sticky
FL-context property :data:`~fedssl.flare.constants.INIT_PROP` (``{"init": "imagenet" | "random" | "checkpoint",
"path", "sha256"}``, written into summary.json by RunSummary): ``checkpoint`` when ``source_ckpt_file_full_name``
is set, ``imagenet`` when the model component loaded ``imagenet_path``, else ``random`` with a warning that names
the argument to set.  Round 0 delivers these weights, batch-norm included, to every site (BackboneBNExclusion).
"""

from __future__ import annotations


import numpy as np
import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey, make_model_learnable
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from fedssl.core.checks import require
from fedssl.flare.constants import INIT_PROP
from fedssl.flare.surgical_registration import get_registry
from fedssl.flare.weights_only_persistor import describe_init, init_record


def rehead(weight: np.ndarray, bias: np.ndarray, model_classes, global_classes,
           seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Head rows over ``global_classes``: rows of known classes copied by name, new classes freshly initialised."""
    n_feat = weight.shape[1]
    gen = torch.Generator().manual_seed(int(seed))
    bound = 1.0 / float(np.sqrt(n_feat))
    fresh = (torch.rand(len(global_classes), n_feat, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    w = fresh.numpy().astype(weight.dtype)
    b = np.zeros(len(global_classes), dtype=bias.dtype)
    pos = {c: i for i, c in enumerate(model_classes or [])}
    for j, c in enumerate(global_classes):
        if c in pos:
            w[j], b[j] = weight[pos[c]], bias[pos[c]]
    return w, b


class SurgicalModelPersistor(PTFileModelPersistor):
    def __init__(self, model: str = "model", head: str = "classifier", seed: int = 0,
                 source_ckpt_file_full_name: str | None = None):
        """
        Args:
            model: component id of the class-name-bound model (``fedssl.models.densenet.DenseNet121``).
            head: module name of the class layer.
            seed: seed of the rows of classes the model component does not have.
            source_ckpt_file_full_name: optional initial checkpoint (e.g. a centralised or earlier run).
        """
        super().__init__(model=model, source_ckpt_file_full_name=source_ckpt_file_full_name)
        name = type(self).__name__
        require(isinstance(head, str) and bool(head.strip()), name, "head", head, 'e.g. "classifier"')
        require(isinstance(seed, int) and not isinstance(seed, bool), name, "seed", seed, "use an integer")
        self.head = head
        self.seed = seed

    def handle_event(self, event: str, fl_ctx: FLContext) -> None:
        super().handle_event(event, fl_ctx)
        if event == EventType.START_RUN:
            self.announce_init(fl_ctx)

    def announce_init(self, fl_ctx: FLContext) -> dict:
        """Log which initial weights the run starts from (a warning for random init) and set ``INIT_PROP``."""
        record = init_record(self.model, self.source_ckpt_file_full_name)
        fl_ctx.set_prop(INIT_PROP, record, private=True, sticky=True)
        line = describe_init(record, self.model)
        (self.log_warning if record["init"] == "random" else self.log_info)(fl_ctx, line)
        return record

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        learnable = super().load_model(fl_ctx)
        if learnable is None:
            return learnable
        reg = get_registry(fl_ctx, type(self).__name__)
        wk, bk = f"{self.head}.weight", f"{self.head}.bias"
        weights = dict(learnable[ModelLearnableKey.WEIGHTS])
        if wk not in weights or bk not in weights:
            raise ValueError(f"{type(self).__name__}: the model has no {wk!r}/{bk!r}; set the head argument")
        model_classes = list(getattr(self.model, "classes", None) or [])
        if model_classes == list(reg.global_classes):
            return learnable
        w, b = rehead(np.asarray(weights[wk]), np.asarray(weights[bk]), model_classes, list(reg.global_classes),
                      self.seed)
        weights[wk], weights[bk] = w, b
        self.persistence_manager.var_dict[wk] = torch.as_tensor(w)
        self.persistence_manager.var_dict[bk] = torch.as_tensor(b)
        kept = len([c for c in reg.global_classes if c in model_classes])
        self.log_info(fl_ctx, f"global head rebuilt over the {len(reg.global_classes)} registered classes "
                              f"({kept} rows from the model component, {len(reg.global_classes) - kept} new)")
        return make_model_learnable(weights, learnable.get(ModelLearnableKey.META))
