from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.site_executor import SiteExecutor
from tests.unit.flare.fakes import FakeEngine, context


class Echo(SiteExecutor):
    task_handlers = {"train": "train", "bad": "bad"}

    def train(self, shareable, fl_ctx, abort_signal):
        return DXO(DataKind.WEIGHTS, data={"w": 1}).to_shareable()

    def bad(self, shareable, fl_ctx, abort_signal):
        raise ValueError("broken image")


def test_result_carries_the_round_for_result_filters(tmp_path):
    task = Shareable()
    task.set_header(AppConstants.CURRENT_ROUND, 4)
    task.set_header(AppConstants.NUM_ROUNDS, 5)
    reply = Echo().execute("train", task, context(site="site-1", engine=FakeEngine(tmp_path)), Signal())
    assert reply.get_header(AppConstants.CURRENT_ROUND) == 4 and reply.get_header(AppConstants.NUM_ROUNDS) == 5


def test_unknown_task_and_data_errors_become_return_codes(tmp_path):
    ctx = context(site="site-1", engine=FakeEngine(tmp_path))
    assert Echo().execute("validate", Shareable(), ctx, Signal()).get_return_code() == ReturnCode.TASK_UNKNOWN
    assert Echo().execute("bad", Shareable(), ctx, Signal()).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
