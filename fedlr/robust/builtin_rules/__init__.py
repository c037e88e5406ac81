"""fedlr's robust rules, one module each.

Each module calls :func:`~fedlr.robust.registration.register_rule` once;
:mod:`fedlr.robust.rules` imports every module here before the first rule is
looked up. A new rule is a new module here (or a user's module named in
``extensions``), its page ``docs/robust/<name>.md`` and its row in
``tests/unit/test_rule_table.py``.
"""
