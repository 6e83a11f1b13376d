"""A careless or malicious file given to every entry point that reads weights: a pickle payload (unpickling it
would create a marker file, as a real one would run os.system) and a truncated file.

Every entry point (safe_load, a site's checkpoint resume, the pretrained / ImageNet / --init loaders of the
models and experiments, the Fed-BEiT tokenizer, the CLI export / evaluate / finetune commands) must refuse it
with one clear error naming the file, and nothing in the file may run.
"""

import io
import json
import zipfile

import pytest
import torch
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

from fedssl.cli import main
from fedssl.core.safe_load import safe_load
from fedssl.core.tokenizer import load_tokenizer
from fedssl.experiments.fcl_finetune import encoder_init, export_unet_init, load_global_state
from fedssl.experiments.sslfl_local import evaluate_checkpoint, finetune_local
from fedssl.models.densenet import MultiLabelDenseNet
from fedssl.models.vit import TINY_VIT
from fedssl.models.vit_classifier import FineTuneViT, export_encoder, read_checkpoint
from fedssl.train.mim import site_tokenizer
from tests.unit.flare.fakes import FakeEngine, context
from tests.unit.flare.test_trainer_executor_checkpoint import CountingExecutor, task

VIT = dict(image_size=TINY_VIT["image_size"], patch_size=TINY_VIT["patch_size"], embed_dim=TINY_VIT["embed_dim"],
           depth=TINY_VIT["depth"], num_heads=TINY_VIT["num_heads"])
DENSENET = dict(classes=["a", "b"], growth_rate=8, block_config=[2, 2, 2, 2], num_init_features=16, hidden_features=0)


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def checkpoint_resume(path):
    """A site restarts and finds ``path`` as its checkpoint: the task fails with the error line logged."""
    run_dir = path.parent
    (run_dir / "counting_client_state.pt").write_bytes(path.read_bytes())
    reply = CountingExecutor().execute("train", task(1), context(engine=FakeEngine(run_dir), site="site-1"), Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    raise ValueError(f"logged for {run_dir / 'counting_client_state.pt'}")  # its log line is checked by the test


def cli(argv):
    def run(path):
        err = io.StringIO()
        from contextlib import redirect_stderr

        with redirect_stderr(err):
            rc = main([a.replace("{path}", str(path)) for a in argv])
        raise ValueError(f"rc={rc} {err.getvalue()}")
    return run


ENTRY_POINTS = {
    "safe_load": safe_load,
    "checkpoint_resume": checkpoint_resume,
    "densenet_imagenet_path": lambda p: MultiLabelDenseNet(**DENSENET, imagenet_path=str(p)),
    "vit_pretrained_path": lambda p: FineTuneViT(**VIT, pretrained_path=str(p)),
    "vit_imagenet_path": lambda p: FineTuneViT(**VIT, imagenet_path=str(p)),
    "read_checkpoint": lambda p: read_checkpoint(str(p)),
    "export_encoder": lambda p: export_encoder(str(p), str(p.parent / "out.pt")),
    "evaluate_checkpoint": lambda p: evaluate_checkpoint(str(p), str(p.parent), "retina"),
    "sslfl_finetune_init": lambda p: finetune_local(str(p.parent / "no-data"), "retina", {"A": (str(p), "")}),
    "fcl_global_state": lambda p: load_global_state(str(p)),
    "fcl_encoder_init": lambda p: encoder_init(str(p)),
    "export_unet_init": lambda p: export_unet_init(str(p), str(p.parent / "out.pt"), [4] * 6),
    "tokenizer": lambda p: load_tokenizer(str(p)),
    "site_tokenizer": lambda p: site_tokenizer("site-1", str(p), "", 8),
    "cli_fcl_export_unet": cli(["fcl", "export-unet", "{path}", "/nonexistent-out/u.pt"]),
    "cli_sslfl_export_encoder": cli(["sslfl", "export-encoder", "{path}", "/nonexistent-out/e.pt"]),
    "cli_sslfl_evaluate": cli(["sslfl", "evaluate", "{path}", "--test-root", "/nonexistent-test", "--tiny"]),
    "cli_fcl_finetune_init": cli(["fcl", "finetune", "--data-root", "/nonexistent-data", "--init", "A={path}",
                                  "--out", "/nonexistent-out/r.json"]),
    "cli_sslfl_finetune_init": cli(["sslfl", "finetune", "--data-root", "/nonexistent-data", "--init", "A={path}",
                                    "--tiny", "--out", "/nonexistent-out/r.json"]),
}


def payload_file(tmp_path, marker):
    path = tmp_path / "evil.pt"
    torch.save({"model": {"encoder.cls_token": torch.zeros(1), "main.encoder.x": Payload(marker)}}, path)
    return path


def truncated_file(tmp_path):
    path = tmp_path / "truncated.pt"
    buf = io.BytesIO()
    torch.save({"model": {"encoder.cls_token": torch.zeros(64)}}, buf)
    path.write_bytes(buf.getvalue()[:200])
    return path


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kind", ["payload", "truncated"])
def test_every_loader_refuses_the_file_by_name_and_runs_nothing(tmp_path, entry, kind, caplog):
    marker = tmp_path / "ran"
    path = payload_file(tmp_path, marker) if kind == "payload" else truncated_file(tmp_path)
    with pytest.raises(ValueError) as e:
        ENTRY_POINTS[entry](path)
    message = str(e.value)
    assert not marker.exists()
    if entry == "checkpoint_resume":
        line = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(line) == 1 and message.split("for ")[1] in line[0], line
        return
    if entry.startswith("cli_"):
        assert not message.startswith("rc=0") and "Traceback" not in message
    assert str(path) in message, message
    assert "weights_only" not in message  # never torch's advice to load with weights_only=False


def test_a_tokenizer_export_program_with_a_pickled_weight_does_not_run(tmp_path):
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (x[:, :1].mean((2, 3)) * self.w.sum()).long()

    good, evil, marker = tmp_path / "good.pt2", tmp_path / "dvae.pt2", tmp_path / "ran"
    torch.export.save(torch.export.export(Tokens(), (torch.ones(2, 3, 8, 8),)), str(good))
    pickled = io.BytesIO()
    torch.save(Payload(marker), pickled)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("model_weights_config.json"):
                config = json.loads(data)
                config["config"]["w"]["use_pickle"] = True
                data = json.dumps(config).encode()
            elif info.filename.endswith("data/weights/weight_0"):
                data = pickled.getvalue()
            zout.writestr(info, data)
    with pytest.raises(ValueError, match="dvae.pt2.*holds a Python object"):
        load_tokenizer(str(evil))
    assert not marker.exists()
