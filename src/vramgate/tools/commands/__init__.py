"""The ``vramgate`` commands, one module per command or command group.

Each module has ``register(sub)``, which adds its subparser(s) with their options and help and sets the function
that runs the command (``func``); :mod:`vramgate.tools.cli` builds the parser from them and dispatches. Options
several commands share are declared once in :mod:`vramgate.tools.commands.common`.
"""
