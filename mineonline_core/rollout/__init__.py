"""The rollout side of the online loop.

``envproc``      one env per subprocess, observations through shared memory, kill-and-rebuild
``envpool``      ``EnvPool``: a worker's envs started, supervised and rebuilt; ready observations out, actions in
``collector``    ``FragmentCollector``: batched inference over ready envs, fragments (Ray-free)
``stepping``     the one inference interface (``StepRequest``/``StepReply``), envs' recurrent states in device slots
``localpolicy``  ``LocalPolicy``: the policy run in the worker, double-buffered weights, the batched step
``inference``    ``InferenceServer`` actor: one policy for the envs of every worker (``inference: shared``)
``fragbuild``    the fragment under construction, timers, video capture
``worker``       ``RolloutWorker`` actor: collector + send / fetch / report threads
``buffer``       ``ReplayBuffer`` actor: chunks, reuse, staleness, deferred payload deletion
``manager``      ``RolloutManager`` actor, ``launch_rollout_manager``, ``get_rollout_manager``
``startup``      what the manager starts, in order: store host, buffer, statistics, inference server, workers
``supervision``  ``WorkerSupervisor``: the workers' lives, heartbeats, hung workers killed, restart budget
``stats``        ``EpisodeStatistics`` actor

Submodules are imported on use: importing this package must not pull in Ray or torch.
"""
