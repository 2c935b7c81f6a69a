"""Every component's own options (store, env, policy, loggers, trainer) are validated by one function,
``config.messages.validate_options``: the error names the section, the component, the key, the value
and the fix, all problems at once, before Ray starts. Uses the real registry and the built-in and
installed components (``resolve(probe=False)``: nothing is built)."""

from __future__ import annotations

import pytest

from mineonline_core.config import load_config
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import ConfigError
from mineonline_core.registry import get_plugin_manager
from mineonline_core.services.storehost import StoreClient

DB = "rollout_config.replay_buffer_config.database_config"
ENV = {"env_config": {"name": "gymnasium", "id": "CartPole-v1"}, "policy_config": {"name": "mlp"}}


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        resolve(load_config(ENV, overrides), get_plugin_manager(), probe=False)
    return str(info.value)


def test_a_bad_store_option_names_section_component_key_and_fix():
    message = _error([f"{DB}.backend=lmdb", f"{DB}.map_size=5", f"{DB}.map_size_mb=0"])
    assert message.startswith(f"Invalid {DB} for 'lmdb' (2 problems):"), message
    assert f"  - {DB}.map_size: unknown key for 'lmdb' (value 5). Did you mean 'map_size_mb'" in message
    assert f"  - {DB}.map_size_mb: must be >= 1, got 0. Fix: use a value >= 1" in message


def test_env_and_policy_options_read_alike():
    message = _error(["env_config.idd=3"])
    assert message.startswith("Invalid env_config for 'gymnasium' (1 problem):")
    assert "env_config.idd: unknown key for 'gymnasium' (value 3). Did you mean 'id'? Fix: rename the key." in message
    message = _error(["policy_config.activation=swish", "policy_config.zzzz=1"])
    assert message.startswith("Invalid policy_config for 'mlp' (2 problems):")
    assert "policy_config.activation: " in message and "'swish'" in message
    assert "policy_config.zzzz: unknown key for 'mlp' (value 1). Fix: remove it, or use one of mlp's keys (" in message


def test_a_store_client_given_plain_options_validates_them_the_same_way():
    from mineonline_lmdb import LMDBStore

    with pytest.raises(ConfigError, match=rf"{DB}\.map_sise: unknown key for 'lmdb'.*'map_size_mb'"):
        StoreClient(
            host=None, store_cls=LMDBStore, path="/nonexistent", num_shards=1, options={"map_sise": 1}, host_node_id=""
        )
