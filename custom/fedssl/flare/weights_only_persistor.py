"""FLARE's PyTorch model persistor, with ``weights_only`` loading that a job cannot switch off.

``PTFileModelPersistor`` takes ``load_weights_only`` (default true): a job that sets it false makes the server
unpickle the checkpoint file the job names (``source_ckpt_file_full_name``), i.e. run whatever code the file
holds.  The bundle's jobs use this subclass instead, and the sites' allow-list names it rather than FLARE's
class, so no job configuration can turn the unsafe load on.  Everything else is FLARE's persistor unchanged.
"""

from __future__ import annotations

from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor


class WeightsOnlyPersistor(PTFileModelPersistor):
    def __init__(self, **kwargs):
        """Takes PTFileModelPersistor's arguments (``model``, ``source_ckpt_file_full_name``, ...) except
        ``load_weights_only``, which is always true."""
        if "load_weights_only" in kwargs:
            raise ValueError(f"{type(self).__name__}: argument load_weights_only={kwargs['load_weights_only']!r} is "
                             "not accepted; checkpoints are always loaded with weights_only=True (tensors only). "
                             "Remove the argument; convert a checkpoint that needs pickled objects to a plain state dict")
        super().__init__(**kwargs, load_weights_only=True)
