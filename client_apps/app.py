"""The ClientApp of this repository's ``flwr run`` (``client_apps.app:app``).

The app object and its payload handlers are in the installed package
(:mod:`fedlr.client_apps`); this module only names it for
``[tool.flwr.app.components]``.
"""

from __future__ import annotations

from fedlr.launch.client_app import app

__all__ = ["app"]
