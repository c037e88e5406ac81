"""The ServerApp of this repository's ``flwr run`` (``server_apps.app:app``).

The app object and everything it runs are in the installed package
(:mod:`fedlr.server_apps`); this module only names it for
``[tool.flwr.app.components]``, so the app bundle needs nothing outside
``fedlr``.
"""

from __future__ import annotations

from fedlr.server_apps.app import app

__all__ = ["app"]
