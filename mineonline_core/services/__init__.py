"""The services floor: what runs inside a run's actors, rollout workers and trainer ranks, below
``rollout/`` and ``trainer/`` and shared by both.

The actors' names and node (``names``), their log files (``runlog``), the logging actor
(``loggerhub``), the store host (``storehost``), the evaluator (``evaluator``, playing ``episodes``),
heartbeats (``heartbeat``), restart budgets (``restarts``), the finiteness checks (``finite``), the
GPU lease (``gpulease``), episode videos (``video``), weights on the wire and their one receiver
(``weights``) and the handle types of the rollout actors where their class cannot be imported (``handles``).
Plugins never import from here.
"""
