"""The ``wheelhouse`` command: its entry (``main``) and the core's subcommands; web and worker
register their own.
"""
