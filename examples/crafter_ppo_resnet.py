"""Crafter with the tuned PPO of Moon et al. (NeurIPS 2023), 15.6% Crafter score at 1M env steps.

``crafter.py``'s settings, which are theirs, with their network: an IMPALA-ResNet encoder (channels
64/128/128, GroupNorm, dense 256 then 1024 with LayerNorm; the core's ``impala_resnet``) and value
targets normalised by an EWMA with beta 0.99 (the policy's ``value_normalizer_beta``).

The encoder costs about 0.5 GMAC per env step forward: at 1M steps it needs a GPU. On one H200 with 16
cores, 4 rollout workers (inference on the GPU) and the learner on the same GPU collected 1.4k env
steps/s (504k steps in 6.1 minutes); 8 workers, 2.8k (benchmarks/RESULTS.md, issue 19)::

    mineonline run examples/crafter_ppo_resnet.py train_config.num_gpus_per_worker=0.5 \\
        rollout_config.num_rollout_workers=4 rollout_config.num_gpus_per_worker=0.1
    mineonline run examples/crafter_ppo_resnet.py 'policy_config.channels=[16,32,32]'   # narrower

``benchmarks/bench_learning.py --env crafter --config examples/crafter_ppo_resnet.py --steps 1000000
--seeds 0 1 2`` scores it by the paper's rule.
"""

import copy
import runpy
from pathlib import Path

# crafter.py is the single source of the PPO settings; only the network differs.
_base = runpy.run_path(str(Path(__file__).with_name("crafter.py")))
env_generator = _base["env_generator"]
online_dict = copy.deepcopy(_base["online_dict"])
online_dict["policy_config"] = {
    "name": "impala_resnet",
    "channels": [64, 128, 128],
    "blocks_per_stage": 2,
    "group_norm": True,
    "dense_sizes": [256, 1024],
    "layer_norm": True,
    "value_normalizer_beta": 0.99,
}
