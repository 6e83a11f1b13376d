"""Final test of a surgical-aggregation run: FinalEvaluation + the paper's shared / unique AUROC table.

The "test" task goes out with the validation-selected (or last) global model; the server's HeadSlicer for
the test task (``full_head=true``) gives every site the whole global head with the network's class order,
so a site can score its own classes on its test patients and every class of the network on an external
test set.  Besides FinalEvaluation's ``test_metrics.*``, this writes ``results.json`` / ``results.md``
(mean AUROC per site over its classes, its shared classes and its unique classes; external-set means over
all classes and over each site's classes) and ``auroc.png`` (per-class AUROC with 95 % CIs) in the server
run folder.
"""

from __future__ import annotations

from nvflare.apis.fl_context import FLContext

from fedssl.eval.surgical_report import write_results
from fedssl.flare.final_evaluation import FinalEvaluation
from fedssl.flare.surgical_registration import get_registry


class SurgicalEvaluation(FinalEvaluation):
    def write_report(self, report: dict, run_dir: str, fl_ctx: FLContext) -> None:
        super().write_report(report, run_dir, fl_ctx)
        reg = get_registry(fl_ctx, type(self).__name__)
        title = f"{self.title}: {reg.method}, backbone {reg.backbone}"
        payload = write_results(run_dir, report["sites"], reg.to_json(), title, report["model_source"])
        m = payload["table"]["mean"]
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        ext = payload["table"]["external"]
        self.log_info(fl_ctx, f"results ({reg.method}): mean AUROC {fmt(m['mean_auroc'])}, shared "
                              f"{fmt(m['shared_auroc'])}, unique {fmt(m['unique_auroc'])}"
                              + (f"; external {fmt(ext[0]['mean_auroc'])} over {ext[0]['n_classes']} classes" if ext
                                 else "")
                              + f" -> {run_dir}/results.md")
