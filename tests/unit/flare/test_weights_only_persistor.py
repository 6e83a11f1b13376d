import pytest
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from fedssl.flare.weights_only_persistor import WeightsOnlyPersistor
from fedssl.ops.policy import class_allow_list


def test_a_job_cannot_switch_the_unsafe_load_on():
    p = WeightsOnlyPersistor(model="model", source_ckpt_file_full_name="/x/init.pt")
    assert isinstance(p, PTFileModelPersistor) and p.load_weights_only is True
    for value in (False, True):
        with pytest.raises(ValueError, match="load_weights_only=.*not accepted"):
            WeightsOnlyPersistor(model="model", load_weights_only=value)


def test_sites_allow_the_safe_persistor_not_flares():
    allowed = class_allow_list()
    assert "fedssl.flare.weights_only_persistor.WeightsOnlyPersistor" in allowed
    assert "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor" not in allowed
