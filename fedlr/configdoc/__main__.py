"""``python -m fedlr.configdoc write|check`` (:func:`fedlr.configdoc.generate.main`)."""

import sys

from fedlr.configdoc.generate import main

sys.exit(main())
