import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey

from fedssl.flare.feature_bank_perturbation import FeatureBankPerturbation
from fedssl.flare.party_folder import SECRETS_DIR_ENV
from tests.unit.flare.fakes import FakeEngine, context


@pytest.fixture(autouse=True)
def no_secrets_dir(monkeypatch):
    monkeypatch.delenv(SECRETS_DIR_ENV, raising=False)


def result(bank, round_idx=3, **meta):
    s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={"bank_features": bank, **meta}).to_shareable()
    if round_idx is not None:
        s.set_header("current_round", round_idx)
    return s


def site_ctx(folder, task_round=None):
    """site-1's context as its result leaves; ``folder``: its site config dir; ``task_round``: the task's round."""
    props = {}
    if task_round is not None:
        task = DXO(DataKind.WEIGHTS, data={}).to_shareable()
        task.set_header("current_round", task_round)
        props[FLContextKey.TASK_DATA] = task
    return context(engine=FakeEngine(folder), site="site-1", props=props)


def shared(folder, bank=None, round_idx=3, f=None):
    bank = np.eye(3, dtype=np.float32) if bank is None else bank
    out = (f or FeatureBankPerturbation(sigma=0.2)).process(result(bank, round_idx), site_ctx(folder))
    return from_shareable(out).get_meta_prop("bank_features")


def test_bank_is_perturbed_and_weights_untouched(tmp_path):
    """Each row f becomes normalise(f + N(0, sigma^2 I)), the noise from default_rng([site secret, round]) (the
    secret pinned here to 7 by writing the site's secret file)."""
    path = tmp_path / "feature_bank_perturbation.secret"
    path.write_text(f"{7:032x}\n")
    path.chmod(0o600)
    bank = np.eye(3, dtype=np.float32)
    s = result(bank, round_idx=3, num_samples=2)
    out = from_shareable(FeatureBankPerturbation(sigma=0.2).process(s, site_ctx(tmp_path)))
    noisy = bank + 0.2 * np.random.default_rng([7, 3]).standard_normal((3, 3)).astype(np.float32)
    expected = noisy / np.sqrt((noisy ** 2).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(out.get_meta_prop("bank_features"), expected, rtol=1e-5, atol=1e-6)
    assert out.get_meta_prop("num_samples") == 2 and np.allclose(out.data["w"], 1.0)


def test_the_site_secret_is_drawn_once_kept_and_shared_by_instances_on_the_same_folder(tmp_path):
    f = FeatureBankPerturbation(sigma=0.2)
    assert not any(tmp_path.iterdir())  # building the filter touches no folder (it has no context yet)
    first = shared(tmp_path / "a", f=f)
    assert (tmp_path / "a" / "feature_bank_perturbation.secret").stat().st_mode & 0o777 == 0o600
    np.testing.assert_array_equal(shared(tmp_path / "a"), first)  # a rerun / another process on the same folder
    assert not np.allclose(shared(tmp_path / "b"), first)  # another site (folder): other noise


def test_noise_is_a_pure_function_of_secret_and_round(tmp_path):
    """Not a generator advanced across calls: a restarted site continues the same sequence, the same round's result
    sent twice carries the same noise, and every round has its own."""
    f = FeatureBankPerturbation(sigma=0.2)
    rounds = {r: shared(tmp_path, round_idx=r, f=f) for r in (0, 1, 2)}
    np.testing.assert_array_equal(shared(tmp_path, round_idx=2, f=f), rounds[2])  # re-sent: identical
    np.testing.assert_array_equal(shared(tmp_path, round_idx=2), rounds[2])  # restarted site
    assert not np.allclose(rounds[0], rounds[1]) and not np.allclose(rounds[1], rounds[2])


def test_the_round_comes_from_the_task_when_the_result_lacks_it(tmp_path):
    f = FeatureBankPerturbation(sigma=0.2)
    out = f.process(result(np.eye(3, dtype=np.float32), round_idx=None), site_ctx(tmp_path, task_round=2))
    np.testing.assert_array_equal(from_shareable(out).get_meta_prop("bank_features"), shared(tmp_path, round_idx=2))


@pytest.mark.parametrize("bad", [None, -1, "2", True, 1.0])
def test_a_result_without_a_round_is_refused_not_sent_with_repeated_noise(tmp_path, bad):
    s = result(np.eye(3, dtype=np.float32), round_idx=bad)
    with pytest.raises(RuntimeError, match="FeatureBankPerturbation: the result carries no round"):
        FeatureBankPerturbation().process(s, site_ctx(tmp_path))


def test_a_secret_open_to_others_stops_the_filter_in_one_line_naming_the_file(tmp_path):
    shared(tmp_path)
    path = tmp_path / "feature_bank_perturbation.secret"
    path.chmod(0o644)
    with pytest.raises(RuntimeError, match=f"party secret {path} has mode 0644"):
        shared(tmp_path)


def test_without_bank_nothing_changes():
    s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable()
    assert FeatureBankPerturbation().process(s, context()) is s


@pytest.mark.parametrize("sigma", [0, -1, "0.1", None])
def test_misconfigured_filter_refuses_to_build(sigma):
    with pytest.raises(ValueError, match="sigma"):
        FeatureBankPerturbation(sigma=sigma)
