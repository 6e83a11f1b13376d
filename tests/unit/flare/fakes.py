"""Minimal FLARE stand-ins for unit tests: a context with a peer site and an engine with a run folder."""

from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal


class FakeWorkspace:
    def __init__(self, root):
        self.root = str(root)

    def get_run_dir(self, job_id):
        return self.root

    def get_site_config_dir(self):
        return self.root


class FakeClient:
    def __init__(self, name):
        self.name = name


class FakeEngine:
    def __init__(self, root, n_clients=3, components=None, sites=None):
        """``sites``: the names of the run's clients (default site-1 .. site-<n_clients>)."""
        self.ws = FakeWorkspace(root)
        self.sites = list(sites) if sites is not None else [f"site-{i}" for i in range(1, n_clients + 1)]
        self.n_clients = len(self.sites)
        self.components = dict(components or {})

    def get_workspace(self):
        return self.ws

    def get_clients(self):
        return [FakeClient(s) for s in self.sites]

    def fire_event(self, event_type, fl_ctx):
        """log_error fires an event; nothing listens in unit tests."""

    def get_component(self, component_id):
        """The components given (none by default, e.g. no analytics writer: TrainerExecutor then writes its
        metrics file only)."""
        return self.components.get(component_id)


def context(peer_site=None, engine=None, props=None, site=None) -> FLContext:
    ctx = FLContext()
    if site is not None:
        ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
        ctx.set_prop(ReservedKey.RUN_NUM, "job-1", private=False, sticky=False)
    if peer_site is not None:
        peer = FLContext()
        peer.set_prop(ReservedKey.IDENTITY_NAME, peer_site, private=False, sticky=False)
        ctx.set_peer_context(peer)
    if engine is not None:
        ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    for k, v in (props or {}).items():
        ctx.set_prop(k, v, private=True, sticky=False)
    return ctx


def contribution(site, weights, meta=None, round_idx=0) -> Shareable:
    s = DXO(DataKind.WEIGHTS, data=weights, meta=meta or {}).to_shareable()
    s.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    s.add_cookie("contribution_round", round_idx)
    return s


class CountingSignal(Signal):
    """FLARE's abort signal, triggered from the ``after``-th time it is read (an abort arriving mid-round)."""

    def __init__(self, after):
        super().__init__()
        self.reads, self.after = 0, after

    @property
    def triggered(self):
        self.reads += 1
        return self.reads >= self.after
