"""The run every program shares: settings, command line, plan, roles, loop, resume, metrics."""
