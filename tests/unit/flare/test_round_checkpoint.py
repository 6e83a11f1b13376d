"""RoundCheckpoint: a resubmitted job resumes its ScatterAndGather at the round after the last one finished."""


import numpy as np
import pytest
import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from fedssl.flare import round_checkpoint as rc
from fedssl.flare.fclopt_controller import FCLOptController
from fedssl.flare.run_summary import SUMMARY_RECORD_EVENT
from tests.unit.flare.fakes import FakeEngine, context


class Workspace:
    def __init__(self, root, config_dir):
        self.root, self.config_dir = str(root), str(config_dir)

    def get_root_dir(self):
        return self.root

    def get_app_config_dir(self, job_id):
        return self.config_dir


def _model(scale=1.0):
    return {"w": np.full((2, 3), scale, np.float32), "n": np.array(7, np.int64)}


class Selector:
    """What RoundCheckpoint reads of FLARE's IntimeModelSelector."""

    def __init__(self):
        self.best_val_metric, self.best_raw_val_metric = -np.inf, None


class RecordingEngine(FakeEngine):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.fired = []

    def fire_event(self, event_type, fl_ctx):
        learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        self.fired.append((event_type, learnable[ModelLearnableKey.WEIGHTS]["w"].copy() if learnable else None,
                           fl_ctx.get_prop(AppConstants.CURRENT_ROUND),
                           fl_ctx.get_prop(AppConstants.METRICS_SELECTION_INFO)))


def _setup(tmp_path, config=b'{"num_rounds": 4}', num_rounds=4, controller=None, signal=None, selector=None):
    """An engine whose workflow "sag" is a ScatterAndGather started with a fresh global model, and its context."""
    cfg = tmp_path / "app_config"
    cfg.mkdir(exist_ok=True)
    (cfg / "config_fed_server.json").write_bytes(config)
    sag = controller or ScatterAndGather(min_clients=2, num_rounds=num_rounds)
    sag._global_weights = make_model_learnable(_model(), {"initial": True})  # what start_controller loaded
    engine = RecordingEngine(tmp_path, components={"sag": sag, **({"model_selector": selector} if selector else {})})
    engine.ws = Workspace(tmp_path / "server", cfg)
    ctx = context(engine=engine, props={FLContextKey.WORKFLOW: "sag"})
    ctx.set_prop(ReservedKey.RUN_NUM, "job-1", private=False, sticky=False)
    ctx.set_prop(ReservedKey.RUN_ABORT_SIGNAL, signal or Signal(), private=True, sticky=False)
    return sag, ctx


def _round_done(comp, ctx, round_idx, scale):
    ctx.set_prop(AppConstants.CURRENT_ROUND, round_idx, private=True, sticky=False)
    ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(_model(scale), {}), private=True, sticky=False)
    comp.handle_event(AppEventType.ROUND_DONE, ctx)


def test_a_killed_run_resumes_at_the_next_round_with_the_last_global_model(tmp_path):
    comp = rc.RoundCheckpoint()
    _, ctx = _setup(tmp_path)
    comp.handle_event(EventType.START_WORKFLOW, ctx)  # nothing to resume: round 0, the persistor's model
    _round_done(comp, ctx, 0, 2.0)
    _round_done(comp, ctx, 1, 3.0)  # the server is killed during round 2: the run does not end
    files = list((tmp_path / "server" / "resume").rglob("*.pt"))
    assert len(files) == 1 and files[0].name == "sag.pt"
    state = torch.load(files[0], weights_only=True)
    assert int(state["round"]) == 1 and int(state["end_round"]) == 4

    # the same job submitted again: a new component and controller, the same config
    again = rc.RoundCheckpoint()
    sag, ctx2 = _setup(tmp_path)
    again.handle_event(EventType.START_WORKFLOW, ctx2)
    assert sag._current_round == 2 and sag._start_round == 0 and sag._num_rounds == 4
    w = sag._global_weights[ModelLearnableKey.WEIGHTS]
    assert w["w"].dtype == np.float32 and np.all(w["w"] == 3.0) and int(w["n"]) == 7
    assert sag._global_weights[ModelLearnableKey.META] == {"initial": True}
    assert ctx2.get_prop(AppConstants.GLOBAL_MODEL) is sag._global_weights
    assert ctx2.get_prop(SUMMARY_RECORD_EVENT) == {"resumed_after_round": 1}  # summary.json says so
    _round_done(again, ctx2, 2, 4.0)
    _round_done(again, ctx2, 3, 5.0)
    again.handle_event(EventType.ABOUT_TO_END_RUN, ctx2)  # ended normally: the next run starts at round 0
    assert not list((tmp_path / "server" / "resume").rglob("*.pt"))
    fresh, ctx3 = _setup(tmp_path)
    rc.RoundCheckpoint().handle_event(EventType.START_WORKFLOW, ctx3)
    assert fresh._current_round is None  # ScatterAndGather starts at start_round


def test_an_aborted_run_keeps_its_checkpoint_and_a_finished_workflow_resumes_past_its_rounds(tmp_path):
    signal = Signal()
    comp = rc.RoundCheckpoint()
    _, ctx = _setup(tmp_path, signal=signal)
    comp.handle_event(EventType.START_WORKFLOW, ctx)
    for r in range(4):
        _round_done(comp, ctx, r, 1.0 + r)
    signal.trigger("aborted by the admin")  # e.g. killed during the final evaluation
    comp.handle_event(EventType.ABOUT_TO_END_RUN, ctx)
    sag, ctx2 = _setup(tmp_path)
    rc.RoundCheckpoint().handle_event(EventType.START_WORKFLOW, ctx2)
    assert sag._current_round == 4  # the loop runs no round; the final evaluation runs on round 3's model
    assert np.all(sag._global_weights[ModelLearnableKey.WEIGHTS]["w"] == 4.0)


def test_another_job_or_a_checkpoint_that_does_not_fit_starts_afresh(tmp_path):
    comp = rc.RoundCheckpoint()
    _, ctx = _setup(tmp_path)
    comp.handle_event(EventType.START_WORKFLOW, ctx)
    _round_done(comp, ctx, 0, 2.0)
    other, ctx2 = _setup(tmp_path, config=b'{"num_rounds": 4, "seed": 1}')  # another job: another digest
    rc.RoundCheckpoint().handle_event(EventType.START_WORKFLOW, ctx2)
    assert other._current_round is None
    longer, ctx3 = _setup(tmp_path, num_rounds=6)  # same files, other rounds: refused with one line
    warnings = []
    c3 = rc.RoundCheckpoint()
    c3.log_warning = lambda fl_ctx, msg, *a, **k: warnings.append(msg)
    c3.handle_event(EventType.START_WORKFLOW, ctx3)
    assert longer._current_round is None and "ends at round 4" in warnings[0] and "starting at round 0" in warnings[0]


@pytest.mark.parametrize("bad, says", [
    ({"w": torch.zeros(2, 3)}, "missing ['n']"),
    ({"w": torch.zeros(3, 2), "n": torch.tensor(7)}, "shape (2, 3)"),
    ({"w": torch.zeros(2, 3, dtype=torch.float64), "n": torch.tensor(7)}, "float32 tensor"),
])
def test_load_checkpoint_names_what_does_not_fit(tmp_path, bad, says):
    path = str(tmp_path / "c.pt")
    torch.save({"round": torch.tensor(1), "end_round": torch.tensor(4), "weights": bad}, path)
    with pytest.raises(ValueError, match=None) as e:
        rc.load_checkpoint(path, _model(), 4)
    assert says in str(e.value)


def test_a_controller_with_more_state_is_not_resumed(tmp_path):
    ctl = FCLOptController(min_clients=2, num_rounds=4)
    comp = rc.RoundCheckpoint()
    warnings = []
    comp.log_warning = lambda fl_ctx, msg, *a, **k: warnings.append(msg)
    _, ctx = _setup(tmp_path, controller=ctl)
    comp.handle_event(EventType.START_WORKFLOW, ctx)
    _round_done(comp, ctx, 0, 2.0)
    assert "FCLOptController keeps state" in warnings[0] and not (tmp_path / "server" / "resume").exists()


def test_the_digest_covers_every_config_file(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    d1 = rc.job_digest(str(tmp_path))
    (tmp_path / "b.json").write_text("{}")
    d2 = rc.job_digest(str(tmp_path))
    (tmp_path / "b.json").write_text("{ }")
    d3 = rc.job_digest(str(tmp_path))
    (tmp_path / "b.json").rename(tmp_path / "c.json")  # the same bytes under another name
    d4 = rc.job_digest(str(tmp_path))
    assert len({d1, d2, d3, d4}) == 4
    (tmp_path / ".__nvfl_sig.json").write_text("a new signature per submission")  # FLARE's, not the job's
    assert rc.job_digest(str(tmp_path)) == d4


def test_a_global_model_of_tensors_round_trips_as_tensors(tmp_path):
    """After aggregation FLARE's global model may hold torch tensors (a non-contiguous one included)."""
    ref = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "n": torch.tensor(7)}
    path = str(tmp_path / "c.pt")
    rc.save_checkpoint(path, ref, 1, 4)
    done, got, info = rc.load_checkpoint(path, ref, 4)
    assert done == 1 and info == "" and isinstance(got["w"], torch.Tensor) and torch.equal(got["w"], ref["w"])
    assert int(got["n"]) == 7
    mixed = {"w": np.zeros((3, 2), np.float32), "n": np.array(7)}
    assert isinstance(rc.load_checkpoint(path, mixed, 4)[1]["w"], np.ndarray)


@pytest.mark.parametrize("folder", ["", "  ", 3, None, "/etc/fedssl", "../outside", "a/../../b"])
def test_folder_is_checked_at_once_and_stays_inside_the_server_workspace(folder):
    with pytest.raises(ValueError, match="folder"):
        rc.RoundCheckpoint(folder=folder)


def test_a_nested_folder_is_used_inside_the_workspace_and_a_strange_workflow_id_writes_nothing(tmp_path):
    comp = rc.RoundCheckpoint(folder="state/resume")
    _, ctx = _setup(tmp_path)
    comp.handle_event(EventType.START_WORKFLOW, ctx)
    _round_done(comp, ctx, 0, 2.0)
    assert len(list((tmp_path / "server" / "state" / "resume").rglob("sag.pt"))) == 1
    (tmp_path / "other").mkdir()
    _, ctx2 = _setup(tmp_path / "other")
    sag2 = ScatterAndGather(min_clients=2, num_rounds=4)
    ctx2.get_engine().components["../../x"] = sag2
    ctx2.set_prop(FLContextKey.WORKFLOW, "../../x", private=True, sticky=False)
    warnings = []
    other = rc.RoundCheckpoint()
    other.log_warning = lambda fl_ctx, msg, *a, **k: warnings.append(msg)
    other.handle_event(EventType.START_WORKFLOW, ctx2)
    _round_done(other, ctx2, 0, 2.0)
    assert "is no file name" in warnings[0] and not list(tmp_path.rglob("x.pt"))


def test_the_best_model_so_far_and_its_metric_survive_a_restart(tmp_path):
    """Fine-tuning jobs select the best global model on validation: a resumed run goes on selecting over all the
    job's rounds and its persistor / final evaluation get round 0's best model, as in an uninterrupted run."""
    selector = Selector()
    comp = rc.RoundCheckpoint()
    _, ctx = _setup(tmp_path, selector=selector)
    comp.handle_event(EventType.START_WORKFLOW, ctx)
    ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
    ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(_model(1.5), {}), private=True, sticky=False)
    selector.best_val_metric, selector.best_raw_val_metric = 0.7, 0.7
    info = {"best_round": 0, "key_metric": "val_accuracy", "best_metrics": {"val_accuracy": np.float64(0.7)}}
    ctx.set_prop(AppConstants.METRICS_SELECTION_INFO, info, private=True, sticky=False)
    ctx.set_prop(AppConstants.VALIDATION_RESULT, 0.7, private=True, sticky=False)
    comp.handle_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, ctx)  # round 0's incoming model is the best
    _round_done(comp, ctx, 0, 2.0)
    _round_done(comp, ctx, 1, 3.0)  # round 1 was no better; then the server is killed

    fresh = Selector()
    sag, ctx2 = _setup(tmp_path, selector=fresh)
    again = rc.RoundCheckpoint()
    again.handle_event(EventType.START_WORKFLOW, ctx2)
    assert sag._current_round == 2 and fresh.best_val_metric == 0.7 and fresh.best_raw_val_metric == 0.7
    best = [f for f in ctx2.get_engine().fired if f[0] == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE]
    assert len(best) == 1 and np.all(best[0][1] == 1.5) and best[0][2] == 0  # round 0's model, as round 0
    assert best[0][3] == {"best_round": 0, "key_metric": "val_accuracy", "best_metrics": {"val_accuracy": 0.7}}
    assert np.all(ctx2.get_prop(AppConstants.GLOBAL_MODEL)[ModelLearnableKey.WEIGHTS]["w"] == 3.0)  # then resumed
