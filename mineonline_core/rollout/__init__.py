"""The rollout side of the online loop.

``envproc``    one env per subprocess, observations through shared memory, kill-and-rebuild
``collector``  ``FragmentCollector``: batched inference over ready envs, fragments (Ray-free)
``fragbuild``  the fragment under construction, timers, video capture
``worker``     ``RolloutWorker`` actor: collector + send / fetch / report threads
``buffer``     ``ReplayBuffer`` actor: chunks, reuse, staleness, deferred payload deletion
``manager``    ``RolloutManager`` actor, ``launch_rollout_manager``, ``get_rollout_manager``
``stats``      ``EpisodeStatistics`` actor

Submodules are imported on use: importing this package must not pull in Ray or torch.
"""
