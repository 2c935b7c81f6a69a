"""Crafter on 2 CPU cores: Moon et al.'s PPO hyperparameters with the Nature CNN (`cnn`).

The tuned PPO of ``crafter_ppo_resnet.py`` (8 envs x 512 steps per iteration, 3 epochs x 8 minibatches,
lr 3e-4, entropy 0.01, gamma 0.95, GAE lambda 0.65, advantages normalised over the batch, value targets
normalised) with SB3's ``CnnPolicy`` network in place of the IMPALA-ResNet, which a 2-core CPU cannot
afford at 1M steps. One seed on this project's 2-core machine: Crafter score 8.6 % over all training
episodes up to 1M env steps (the paper's rule), 10.3 % over the last 20 episodes, in 67 minutes
(benchmarks/RESULTS.md, issue 19)::

    python benchmarks/bench_learning.py --env crafter --config examples/crafter_cnn.py --steps 1000000 --seeds 0 1 2
"""

import copy
import runpy
from pathlib import Path

# The published recipe's module is the single source of its settings; only the network and the iteration cap differ.
_recipe = runpy.run_path(str(Path(__file__).with_name("crafter_ppo_resnet.py")))
env_generator = _recipe["env_generator"]
online_dict = copy.deepcopy(_recipe["online_dict"])
online_dict["policy_config"] = {"name": "cnn"}
# An upper bound: train_config.max_env_steps ends the run at 1M collected steps.
online_dict["train_config"]["num_iterations"] = 400
