"""``python -m kvhandoff.sim prefill|decode '<json config>'``: one simulated engine
(`kvhandoff.sim.engine.main`)."""

import sys

from kvhandoff.sim.engine import main

sys.exit(main())
