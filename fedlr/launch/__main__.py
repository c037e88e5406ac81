"""``python -m fedlr.launch`` (:func:`fedlr.launch.flwr_run.main`)."""

import sys

from fedlr.launch.flwr_run import main

sys.exit(main())
