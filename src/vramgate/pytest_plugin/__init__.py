"""The pytest plugin: options, marks, the ``gate`` fixture, the session that checks and reports,
hygiene, and the xdist transport."""
