"""``nvflare simulator`` with FLARE 2.9's site-name race fixed: ``python -m fedssl.ops.flare_simulator simulator ...``
takes the arguments of ``nvflare`` and runs FLARE's own command line after
:func:`~fedssl.flare.simulator_site_names.fix_site_names` (the race and the fix are described there).  FLARE's
simulator starts its runner in a forked process, which inherits the fix.
"""

from __future__ import annotations

import sys

from fedssl.flare.simulator_site_names import SiteNameContext, fix_site_names

__all__ = ["SiteNameContext", "fix_site_names", "main"]


def main(argv: list[str] | None = None) -> int:
    """FLARE's ``nvflare`` command line (``argv`` as its arguments) with :func:`fix_site_names` applied."""
    fix_site_names()
    from nvflare.cli import main as nvflare_main

    sys.argv = ["nvflare", *(sys.argv[1:] if argv is None else argv)]
    return nvflare_main() or 0  # FLARE's main exits with a failed run's status itself


if __name__ == "__main__":
    sys.exit(main())
