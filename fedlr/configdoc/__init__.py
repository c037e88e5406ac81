"""The generated docs: ``python -m fedlr.configdoc write|check``.

:mod:`fedlr.configdoc.generate` renders the run-config keys, the methods
table and the plug-in table from the option declarations and the method
registry; :mod:`fedlr.configdoc.features` renders the client features' wire
keys, records and privacy rows. The package sits on the top floor: it reads
every declaration and nothing imports it.
"""
