"""The machinery behind ``mineonline run``: resolving a config into components, the run directory,
the Ray actors that host stores and loggers, watchdogs, resume, evaluation and the console. Plugin
authors never import from here."""
