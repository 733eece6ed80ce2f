"""Reports rendered from plain data: the terminal table, report.md, report.json, changes.png.

Never imports the pytest plugin: the plugin hands a :class:`~vramgate.report.summary.Summary` over."""
