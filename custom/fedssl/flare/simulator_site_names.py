"""FLARE 2.9's simulator site-name race, fixed in the process that runs the simulator's sites.

The race (FLARE 2.9.0, ``nvflare/private/fed/app/simulator/simulator_runner.py``): each site's runner thread, in
``SimulatorClientRunner.do_one_task``, writes its site's name into ``self.build_ctx["client_name"]``, a dictionary
all site threads share, and then sends that dictionary to the site's new worker process, which builds its client
under the name it finds there.  When two threads do this together (they wake from the same 1 s poll in
``_create_connection``), one worker gets the other site's name.  Seen in this bundle's tests: the server log's
``peer=site-3 ... got result from client site-2`` with the aggregator's "already contributed ... duplicate
discarded" (the round trains one site's data twice and another's never), and two workers under one name evicting
each other's connection ("Connection ... is evicted ... from endpoint site-3.simulate_job for exceeding limit 1")
until the run's timeout.

:func:`fix_site_names` gives each thread its own name: the runner's ``build_ctx`` becomes a :class:`SiteNameContext`,
which keeps ``client_name`` per thread and is sent (pickled) as a plain dictionary holding the sending thread's
name.  Two ways apply it: ``python -m fedssl.ops.flare_simulator simulator ...`` (what ``fedssl simulate`` runs)
before FLARE's command line starts, and :func:`fix_in_simulator`, which every job's ``RunSummary`` calls when the
server builds it.  In the simulator the server's components are built before the site runner is (FLARE starts the
server app, waits until it has started, then creates ``SimulatorClientRunner``), so a plain ``nvflare simulator``
of a bundle job gets the fix too.  Outside the simulator (a provisioned server, POC) the simulator's module is not
loaded and :func:`fix_in_simulator` changes nothing.
"""

from __future__ import annotations

import sys
import threading

#: the FLARE module whose ``SimulatorClientRunner`` has the race; loaded only in a simulator's process
SIMULATOR_MODULE = "nvflare.private.fed.app.simulator.simulator_runner"
NAME_KEY = "client_name"


class SiteNameContext(dict):
    """A build context whose ``client_name`` is the one the calling thread set; pickled as a plain ``dict``."""

    def __init__(self, base: dict):
        super().__init__(base)
        self._names = threading.local()

    def __setitem__(self, key, value) -> None:
        if key == NAME_KEY:
            self._names.value = value
        else:
            super().__setitem__(key, value)

    def __getitem__(self, key):
        if key == NAME_KEY and hasattr(self._names, "value"):
            return self._names.value
        return super().__getitem__(key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def snapshot(self) -> dict:
        """What the calling thread sends: the shared entries and its own site's name."""
        out = dict(self.items())
        if hasattr(self._names, "value"):
            out[NAME_KEY] = self._names.value
        return out

    def __reduce_ex__(self, protocol):  # pickle, copy and deepcopy all see the calling thread's plain dict
        return dict, (self.snapshot(),)


def fix_site_names(runner_class=None) -> None:
    """Make ``SimulatorClientRunner`` (or ``runner_class``) hold its build context as a :class:`SiteNameContext`;
    applying it twice changes nothing."""
    if runner_class is None:
        from nvflare.private.fed.app.simulator.simulator_runner import SimulatorClientRunner as runner_class
    if getattr(runner_class, "_fedssl_site_names_fixed", False):
        return
    original_init = runner_class.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if isinstance(self.build_ctx, dict) and not isinstance(self.build_ctx, SiteNameContext):
            self.build_ctx = SiteNameContext(self.build_ctx)

    runner_class.__init__ = __init__
    runner_class._fedssl_site_names_fixed = True


def fix_in_simulator() -> bool:
    """:func:`fix_site_names` when this process runs FLARE's simulator (its runner module is loaded); True when the
    simulator's runner class now has the fix, False outside the simulator (nothing is imported or changed)."""
    module = sys.modules.get(SIMULATOR_MODULE)
    runner_class = getattr(module, "SimulatorClientRunner", None) if module is not None else None
    if runner_class is None:
        return False
    fix_site_names(runner_class)
    return True
