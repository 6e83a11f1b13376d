"""The global head is rebuilt over the registered classes by name (known rows kept, new rows seeded)."""

import numpy as np

from fedssl.flare.surgical_persistor import rehead


def test_rows_follow_names_and_new_rows_are_seeded():
    w = np.array([[1, 1], [2, 2]], np.float32)
    b = np.array([1, 2], np.float32)
    nw, nb = rehead(w, b, ["A", "B"], ["B", "C", "A"], seed=0)
    np.testing.assert_array_equal(nw[0], [2, 2]) and np.testing.assert_array_equal(nw[2], [1, 1])
    np.testing.assert_array_equal(nb, [2, 0, 1])
    assert np.all(np.abs(nw[1]) <= 1 / np.sqrt(2)) and np.any(nw[1] != 0)
    again, _ = rehead(w, b, ["A", "B"], ["B", "C", "A"], seed=0)
    np.testing.assert_array_equal(nw, again)
    other, _ = rehead(w, b, ["A", "B"], ["B", "C", "A"], seed=1)
    assert not np.array_equal(nw[1], other[1])


# ------------------------------------------------------------------------------------ initial weights (issue 13 item 2)
def start_run(tmp_path, model):
    """The persistor's START_RUN on a fake server: returns (persistor, FL context)."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import FLContextKey

    from fedssl.flare.surgical_persistor import SurgicalModelPersistor
    from tests.unit.flare.fakes import FakeEngine, context

    ctx = context(engine=FakeEngine(tmp_path, components={"model": model}),
                  props={FLContextKey.APP_ROOT: str(tmp_path)})
    persistor = SurgicalModelPersistor(model="model")
    persistor.handle_event(EventType.START_RUN, ctx)
    return persistor, ctx


def tiny(imagenet_path=""):
    from fedssl.models.densenet import MultiLabelDenseNet

    return MultiLabelDenseNet(["A", "B"], 8, [2, 2, 2, 2], 16, hidden_features=0, imagenet_path=imagenet_path)


def test_random_init_is_announced_at_start_run_naming_the_argument(tmp_path, caplog):
    from fedssl.flare.constants import INIT_PROP

    caplog.set_level("INFO")
    _, ctx = start_run(tmp_path, tiny(""))
    assert ctx.get_prop(INIT_PROP) == {"init": "random", "path": "", "sha256": ""}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "initial weights: RANDOM" in warnings[0] and '"imagenet_path"' in warnings[0]


def test_imagenet_init_is_recorded_with_path_and_digest(tmp_path, caplog):
    import hashlib

    import torch

    from fedssl.flare.constants import INIT_PROP

    path = tmp_path / "densenet121.pth"
    torch.save({k: v for k, v in tiny("").state_dict().items() if k.startswith("features.")}, path)
    caplog.set_level("INFO")
    _, ctx = start_run(tmp_path, tiny(str(path)))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert ctx.get_prop(INIT_PROP) == {"init": "imagenet", "path": str(path), "sha256": digest}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"initial weights: imagenet from {path} (sha256 {digest})" in r.getMessage() for r in caplog.records)
