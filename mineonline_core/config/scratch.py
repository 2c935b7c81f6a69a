"""Defaults for a policy trained from scratch.

The config models' defaults are MineStudio's, for fine-tuning a pretrained VPT (learning rate 2e-5,
discount 0.999, 4,000 iterations, wandb, the LMDB store): with them a small policy initialised at random
learns next to nothing. A config whose ``policy_config`` names a policy without ``weights_path`` (the key a
policy loads pretrained weights from) and gives no ``policy_generator`` trains from scratch; for it the
keys below that the config leaves out take the values of PPO's reference settings for control tasks
instead (Schulman et al. 2017; Stable-Baselines3's and CleanRL's PPO). A MineStudio ``online_dict`` comes
with its ``policy_generator`` and keeps the fine-tuning defaults, unchanged.

Each group of keys is filled only when the config sets none of its keys, so a key the user sets is
never combined with filled-in keys it constrains (``batches_per_iteration`` is a multiple of
``gradient_accumulation``). The keys filled are written into the config as if the user had written them:
the saved config.yaml, a resume and ``mineonline eval`` read them back as they were.
"""

from __future__ import annotations

from typing import Any

# (group, {key path: value}); the groups are filled independently.
FROM_SCRATCH: tuple[tuple[str, dict[tuple[str, ...], Any]], ...] = (
    ("learning rate", {("train_config", "learning_rate"): 3e-4}),
    ("discount", {("train_config", "discount"): 0.99}),
    ("iterations", {("train_config", "num_iterations"): 300}),
    ("weight decay", {("train_config", "weight_decay"): 0.0}),
    ("gradient clipping", {("train_config", "max_grad_norm"): 0.5}),
    (
        "minibatches",
        {
            ("train_config", "batches_per_iteration"): 4,
            ("train_config", "gradient_accumulation"): 1,
            ("train_config", "epochs_per_iteration"): 4,
        },
    ),
    (
        "replay store",
        {
            ("rollout_config", "replay_buffer_config", "database_config", "backend"): "memory",
            ("rollout_config", "replay_buffer_config", "max_chunks"): 256,
        },
    ),
    ("loggers", {("logger_config", "loggers"): []}),
)


def trains_from_scratch(data: Any) -> bool:
    """Whether the config names a policy by ``policy_config`` with no pretrained weights and no generator."""
    if not isinstance(data, dict) or data.get("policy_generator") is not None:
        return False
    policy = data.get("policy_config")
    return isinstance(policy, dict) and "name" in policy and policy.get("weights_path") is None


def fill_from_scratch_defaults(data: Any) -> tuple[Any, str | None]:
    """``data`` with the from-scratch defaults it leaves out, and the line saying what they are (None
    when the config is not from scratch or sets every key already)."""
    if not trains_from_scratch(data):
        return data, None
    filled: dict[tuple[str, ...], Any] = {}
    for _, keys in FROM_SCRATCH:
        # A section given as something else than a mapping is left for validation to name.
        if not any(_has(data, path) for path in keys) and all(_settable(data, path) for path in keys):
            filled.update(keys)
    if not filled:
        return data, None
    for path, value in filled.items():
        data = _set(data, path, value)
    shown = ", ".join(f"{'.'.join(path)}={_show(value)}" for path, value in filled.items())
    return data, (
        f"from-scratch defaults: {shown} (policy_config names a policy without pretrained weights; set a key to "
        "keep its own value; docs/configuration.md, 'Defaults for a policy trained from scratch')"
    )


def _has(data: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def _settable(data: Any, path: tuple[str, ...]) -> bool:
    for key in path[:-1]:
        data = data.get(key) if isinstance(data, dict) else None
        if data is None:
            return True
        if not isinstance(data, dict):
            return False
    return True


def _set(data: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of ``data`` with ``path`` set (sections that are absent or null become mappings)."""
    out = dict(data)
    head, *rest = path
    if not rest:
        out[head] = value
        return out
    inner = out.get(head)
    out[head] = _set(inner if isinstance(inner, dict) else {}, tuple(rest), value)
    return out


def _show(value: Any) -> str:
    return "[]" if value == [] else str(value)
