"""``python -m kvhandoff.engine_sim prefill|decode '<json config>'``: one simulated engine
(`kvhandoff.engine_sim.engine.main`)."""

import sys

from kvhandoff.engine_sim.engine import main

sys.exit(main())
