"""Server workflow run before ScatterAndGather: every site declares its ordered class list (surgical aggregation
(Kulkarni et al., ML4H 2024) sec. 2.1.1).

Task ``declare_classes`` goes to every site with the run's switches (``method``, ``backbone``); each site
answers with its class list ``C_k`` (from its own site configuration) and its training-set size.  The
server checks every list (``fedssl.core.surgical.check_class_list``: non-empty strings, no duplicates;
names outside ``allowed_classes`` when that vocabulary is given), builds the network's classes
``C = union of C_k`` (stable order: sites sorted by name, each list in its own order) and publishes a
:class:`ClassRegistry` as a sticky FL-context property, read by the persistor (global head of |C|
columns), the aggregator (which site holds which column), the head slicer (what each site receives)
and the results writer.  A bad declaration stops the run before round 0 with an error naming the site:
the global label space must never silently lose a site's classes.  ``classes.json`` in the server run
folder records the registry.

Switches (one place, the sites read them from the task):

| method        | site head | server head                         | site loss                      |
|---------------|-----------|-------------------------------------|--------------------------------|
| surgical      | C_k       | per-class mean over holders (eq. 2) | BCE on C_k                     |
| vanilla       | C         | FedAvg                              | BCE on C, missing = negative   |
| partial_loss  | C         | FedAvg                              | BCE on C_k columns only (eq. 4)|
| personalised  | C_k local | not exchanged                       | BCE on C_k                     |
| individual    | C_k local | nothing exchanged                   | BCE on C_k                     |

backbone: "fedavg" (every backbone tensor averaged), "fedbn" (batch-norm stays local: the job's
BackboneBNExclusion filters follow this switch), "fedbn_plus" (FedBN with batch-norm frozen at its pre-trained
statistics on every site, Kulkarni et al. 2023; the paper's setting).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from nvflare.apis.controller_spec import ClientTask, Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal

from fedssl.core.checks import require, require_choice, require_int
from fedssl.core.surgical import check_class_list, classes_from_meta, union_classes
from fedssl.core.untrusted import as_count
from fedssl.flare.constants import BACKBONE_KEY, BACKBONES, CLASSES_KEY, DECLARE_TASK, METHOD_KEY, METHODS

REGISTRY_PROP = "fedssl.surgical.registry"
REGISTRY_FILE = "classes.json"
#: bound on the training-set size a site may declare (the aggregator caps its num_samples weight by its declaration)
MAX_DECLARED_SAMPLES = 1_000_000


@dataclass(frozen=True)
class ClassRegistry:
    """What the server knows after registration: the switches, the network's classes C and each site's C_k."""

    method: str
    backbone: str
    global_classes: tuple[str, ...]
    site_classes: dict = field(default_factory=dict)  # site -> tuple of names, in the site's order
    num_samples: dict = field(default_factory=dict)  # site -> training images

    def classes_of(self, site: str) -> list[str]:
        if site not in self.site_classes:
            raise ValueError(f"{site} is not registered (registered: {sorted(self.site_classes)}); a site must "
                             f"declare its classes in the {DECLARE_TASK} task before round 0")
        return list(self.site_classes[site])

    def holders(self, cls: str) -> list[str]:
        return sorted(s for s, cs in self.site_classes.items() if cls in cs)

    def shared_classes(self) -> list[str]:
        """Classes held by more than one site (the paper's 'shared'); the others are unique to one site."""
        return [c for c in self.global_classes if len(self.holders(c)) > 1]

    def to_json(self) -> dict:
        return {"method": self.method, "backbone": self.backbone, "global_classes": list(self.global_classes),
                "site_classes": {s: list(c) for s, c in sorted(self.site_classes.items())},
                "shared_classes": self.shared_classes(), "num_samples": dict(self.num_samples)}


def get_registry(fl_ctx: FLContext, component: str) -> ClassRegistry:
    reg = fl_ctx.get_prop(REGISTRY_PROP)
    if not isinstance(reg, ClassRegistry):
        raise ValueError(f"{component}: no class registry in the FL context; put "
                         "fedssl.flare.surgical_registration.ClassRegistration before ScatterAndGather in the "
                         "server's workflows")
    return reg


def build_registry(method: str, backbone: str, declared: dict, allowed_classes=(), num_samples=None) -> ClassRegistry:
    """Validate every site's declaration and build the registry; ValueError names the first bad site."""
    site_classes = {}
    for site in sorted(declared):
        try:
            classes = check_class_list(declared[site], site, allowed=list(allowed_classes) or None)
        except ValueError as e:
            raise ValueError(f"{e} (declared by {site} from its local/fedssl_site.json or the executor "
                             "argument classes; the server's vocabulary is "
                             "ClassRegistration.allowed_classes)") from None
        site_classes[site] = tuple(classes)
    if not site_classes:
        raise ValueError("no site declared its classes")
    global_classes = tuple(union_classes({s: list(c) for s, c in site_classes.items()}))
    return ClassRegistry(method, backbone, global_classes, site_classes, dict(num_samples or {}))


class ClassRegistration(Controller):
    def __init__(self, method: str = "surgical", backbone: str = "fedbn_plus", allowed_classes: list = (),
                 min_clients: int = 2, timeout: int = 600, task_name: str = DECLARE_TASK):
        """
        Args:
            method: "surgical" (paper), "vanilla", "partial_loss", "personalised" or "individual" (module doc).
            backbone: "fedavg", "fedbn" or "fedbn_plus" (paper: FedBN+).
            allowed_classes: the server's vocabulary of class names; a declared name outside it is rejected
                (catches "Effusion" vs "Pleural Effusion"); [] accepts any well-formed name.
            min_clients: declarations needed before training starts (every site of the run).
            timeout: seconds to wait for the declarations (0 = no limit).
        """
        super().__init__()
        name = type(self).__name__
        require_choice(name, "method", method, METHODS)
        require_choice(name, "backbone", backbone, BACKBONES)
        require(isinstance(allowed_classes, (list, tuple))
                and all(isinstance(c, str) and c.strip() for c in allowed_classes)
                and len(set(allowed_classes)) == len(allowed_classes), name, "allowed_classes", allowed_classes,
                'use a list of distinct class names, e.g. ["Atelectasis", "Cardiomegaly"], or [] for any')
        require_int(name, "min_clients", min_clients, 1, "use the number of sites of the run")
        require_int(name, "timeout", timeout, 0, "use seconds (0 = no limit)")
        require(isinstance(task_name, str) and bool(task_name), name, "task_name", task_name, f'use "{DECLARE_TASK}"')
        self.method = method
        self.backbone = backbone
        self.allowed_classes = list(allowed_classes)
        self.min_clients = min_clients
        self.timeout = timeout
        self.task_name = task_name
        self.registry: ClassRegistry | None = None

    def start_controller(self, fl_ctx: FLContext) -> None:
        self.registry = None

    def stop_controller(self, fl_ctx: FLContext) -> None:
        pass

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        self.log_warning(fl_ctx, f"late result of task {task_name} from {client.name} ignored")

    @staticmethod
    def _declaration(ct: ClientTask) -> tuple[list[str] | None, int | None]:
        if ct.result is None:
            return None, None
        dxo = from_shareable(ct.result)
        n = dxo.get_meta_prop("num_samples")
        count = None if n is None else as_count(n, "num_samples", ct.client.name, cap=MAX_DECLARED_SAMPLES)
        return classes_from_meta(dxo.get_meta_prop(CLASSES_KEY), ct.client.name), count

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        data = DXO(data_kind=DataKind.METRICS, data={},
                   meta={METHOD_KEY: self.method, BACKBONE_KEY: self.backbone}).to_shareable()
        task = Task(name=self.task_name, data=data, props={}, timeout=self.timeout)
        self.log_info(fl_ctx, f"asking every site for its class list (method {self.method}, backbone {self.backbone})")
        self.broadcast_and_wait(task=task, min_responses=self.min_clients, wait_time_after_min_received=0,
                                fl_ctx=fl_ctx, abort_signal=abort_signal)
        if abort_signal.triggered:
            return
        declared, counts, problems = {}, {}, []
        for ct in task.client_tasks:
            try:
                classes, n = self._declaration(ct)
            except ValueError as e:
                problems.append(str(e))
                continue
            if classes is None:
                problems.append(f"{ct.client.name} sent no declaration (its {self.task_name} task failed; see its log)")
                continue
            declared[ct.client.name], counts[ct.client.name] = classes, n or 0
        try:
            if problems:
                raise ValueError("; ".join(problems))
            if len(declared) < self.min_clients:
                raise ValueError(f"only {len(declared)} of {self.min_clients} sites declared their classes")
            self.registry = build_registry(self.method, self.backbone, declared, self.allowed_classes, counts)
        except ValueError as e:
            self.log_error(fl_ctx, f"REJECTED class declaration: {e}")
            self.system_panic(f"class registration failed: {e}", fl_ctx)
            return
        fl_ctx.set_prop(REGISTRY_PROP, self.registry, private=True, sticky=True)
        reg = self.registry
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        with open(os.path.join(run_dir, REGISTRY_FILE), "w") as f:
            json.dump(reg.to_json(), f, indent=2)
        self.log_info(fl_ctx, f"registered {len(reg.site_classes)} sites: " + ", ".join(
            f"{s} {len(c)} classes" for s, c in sorted(reg.site_classes.items()))
            + f"; network classes |C| = {len(reg.global_classes)}, shared by >1 site: {len(reg.shared_classes())}")
