"""The driver floor: what runs in the process of ``mineonline run`` (and ``tune``, ``eval``, ``report``,
``status``, ``stop``) and nowhere else.

It turns a config into components before Ray starts (``resolve``, ``envcheck``, ``budget``,
``mainguard``), owns the run directory (``rundir``, ``resume``, ``continuity``), starts and watches the
run (``api``, ``training``, ``placement``, ``watchdog``, ``supervise``, ``lifecycle``), shows it (``progress``) and
reads it afterwards (``report``, ``compare``, ``evaluate``); ``sweep``, ``trial`` and ``tune`` make many
runs of one config. Nothing below this floor imports it (``tests/test_architecture.py``).
"""
