"""FLARE's PyTorch model persistor, with ``weights_only`` loading that a job cannot switch off, and the record of
which initial weights a run starts from.

``PTFileModelPersistor`` takes ``load_weights_only`` (default true): a job that sets it false makes the server
unpickle the checkpoint file the job names (``source_ckpt_file_full_name``), i.e. run whatever code the file
holds.  The bundle's jobs use this subclass instead, and the sites' allow-list names it rather than FLARE's
class, so no job configuration can turn the unsafe load on.

Initial weights (issue 13 item 2): at START_RUN, before any workflow builds or logs anything, the persistor says
in one log line which initial weights the global model starts from and sets the sticky FL-context property
:data:`fedssl.flare.constants.INIT_PROP` = ``{"init": "imagenet" | "random" | "checkpoint", "path", "sha256"}``
(RunSummary writes it to summary.json):

- ``checkpoint``: ``source_ckpt_file_full_name`` (or FLARE's preload path) is set; the file's digest is recorded;
- otherwise what the model component says it was initialised from, its ``initial_weights`` dict (e.g.
  :class:`fedssl.models.vit_classifier.FineTuneViT`: ImageNet weights or a pre-training global model);
- ``random`` for a model component that loaded nothing; the line is then a warning that names the argument to
  set when the model offers one (its ``init_fix`` text).

Everything else is FLARE's persistor unchanged.
"""

from __future__ import annotations

import os

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, WorkspaceConstants
from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from fedssl.core.digest import file_sha256
from fedssl.flare.constants import INIT_PROP

INITS = ("imagenet", "random", "checkpoint")


def init_record(model: object, checkpoint: str | None) -> dict:
    """``INIT_PROP``'s value: the source checkpoint when there is one, else the model component's
    ``initial_weights`` (checked), else random init (empty path and digest)."""
    if checkpoint:
        if not os.path.isfile(checkpoint):
            raise ValueError(f"source checkpoint {checkpoint} does not exist; fix source_ckpt_file_full_name of the "
                             "persistor or remove it")
        return {"init": "checkpoint", "path": checkpoint, "sha256": file_sha256(checkpoint)}
    record = getattr(model, "initial_weights", None)
    if record is None:
        return {"init": "random", "path": "", "sha256": ""}
    if not (isinstance(record, dict) and record.get("init") in INITS and isinstance(record.get("path"), str)
            and isinstance(record.get("sha256"), str)):
        raise ValueError(f"{type(model).__name__}.initial_weights={record!r} is not a record "
                         f"{{'init': one of {list(INITS)}, 'path': str, 'sha256': str}}")
    return {"init": record["init"], "path": record["path"], "sha256": record["sha256"]}


def describe_init(record: dict, model: object) -> str:
    """The log line of the initial weights (random init: with the model's ``init_fix`` when it has one)."""
    if record["init"] == "random":
        fix = getattr(model, "init_fix", "")
        return (f"initial weights: RANDOM initialisation of {type(model).__name__} (no checkpoint, no ImageNet "
                "weights)" + (f"; {fix}" if fix else ""))
    return f"initial weights: {record['init']} from {record['path']} (sha256 {record['sha256']})"


class WeightsOnlyPersistor(PTFileModelPersistor):
    def __init__(self, **kwargs):
        """Takes PTFileModelPersistor's arguments (``model``, ``source_ckpt_file_full_name``, ...) except
        ``load_weights_only``, which is always true."""
        if "load_weights_only" in kwargs:
            raise ValueError(f"{type(self).__name__}: argument load_weights_only={kwargs['load_weights_only']!r} is "
                             "not accepted; checkpoints are always loaded with weights_only=True (tensors only). "
                             "Remove the argument; convert a checkpoint that needs pickled objects to a plain state "
                             "dict")
        super().__init__(**kwargs, load_weights_only=True)

    def source_checkpoint(self, fl_ctx: FLContext) -> str | None:
        """The file FLARE's ``load_model`` reads the initial weights from (same resolution), or None."""
        path = self.source_ckpt_file_full_name
        if path:
            if os.path.isabs(path):
                return path
            return os.path.join(fl_ctx.get_prop(FLContextKey.APP_ROOT) or "", WorkspaceConstants.CUSTOM_FOLDER_NAME,
                                path)
        return self.ckpt_preload_path or None

    def handle_event(self, event: str, fl_ctx: FLContext) -> None:
        super().handle_event(event, fl_ctx)
        if event == EventType.START_RUN:
            self.announce_init(fl_ctx)

    def announce_init(self, fl_ctx: FLContext) -> dict:
        """Log which initial weights the run starts from (a warning for random init) and set ``INIT_PROP``."""
        record = init_record(self.model, self.source_checkpoint(fl_ctx))
        fl_ctx.set_prop(INIT_PROP, record, private=True, sticky=True)
        line = describe_init(record, self.model)
        (self.log_warning if record["init"] == "random" else self.log_info)(fl_ctx, line)
        return record
