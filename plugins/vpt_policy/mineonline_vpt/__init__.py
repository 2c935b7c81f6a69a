"""mineonline-vpt-policy: OpenAI's VPT network, its weight loader and its Minecraft action space.

Select it with ``policy_config: {name: vpt, model_path: foundation-model-1x.model, weights_path:
foundation-model-1x.weights}``; without ``model_path`` the same architecture is built from kwargs
(``hidsize``, ``impala_width``, ...) with a head for the env's action space, e.g. for Crafter.
Python users call ``load_vpt_policy(model_path, weights_path)``.
"""

from __future__ import annotations

from mineonline_core import hookimpl
from mineonline_vpt.loader import VPTModelFileError, VPTWeightsError
from mineonline_vpt.policy import VPTPolicy, VPTPolicyConfig, load_vpt_policy

__all__ = ["VPTModelFileError", "VPTPolicy", "VPTPolicyConfig", "VPTWeightsError", "load_vpt_policy"]


@hookimpl
def mineonline_register_policies(register) -> None:  # type: ignore[no-untyped-def]
    register(VPTPolicy)
