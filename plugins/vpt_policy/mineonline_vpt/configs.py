"""The policy kwargs of OpenAI's released foundation models, to build them without a ``.model`` file.

Values as documented with the public fixture's manifest (``vpt_manifest.json``): 2x is the
``POLICY_KWARGS`` of OpenAI's ``agent.py``; 1x and 3x differ in width only. The released ``.model``
file remains the authority: prefer ``load_vpt_policy(model_path, ...)`` when you have it.
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "attention_mask_style": "clipped_causal",
    "attention_memory_size": 256,
    "diff_mlp_embedding": False,
    "img_shape": [128, 128, 3],
    "impala_chans": [16, 32, 32],
    "impala_kwargs": {"post_pool_groups": 1},
    "init_norm_kwargs": {"batch_norm": False, "group_norm_groups": 1},
    "n_recurrence_layers": 4,
    "only_img_input": True,
    "pointwise_ratio": 4,
    "pointwise_use_activation": False,
    "recurrence_is_residual": True,
    "recurrence_type": "transformer",
    "timesteps": 128,
    "use_pointwise_layer": True,
    "use_pre_lstm_ln": False,
}

FOUNDATION_KWARGS: dict[str, dict[str, Any]] = {
    "foundation-model-1x": {**_COMMON, "hidsize": 1024, "impala_width": 4, "attention_heads": 8},
    "foundation-model-2x": {**_COMMON, "hidsize": 2048, "impala_width": 8, "attention_heads": 16},
    "foundation-model-3x": {**_COMMON, "hidsize": 3072, "impala_width": 12, "attention_heads": 24},
}
FOUNDATION_TEMPERATURE = 2.0
