"""kvsidecar's configuration inside SGLang (``kvsidecar.connector.sglang_config``): typed, from a TOML file
named in SGLang's storage-backend extra config plus inline keys; SGLang's own keys left alone;
every bad key or value a PluginConfigError at start."""

from __future__ import annotations

import pytest

from kvsidecar.connector.sglang_config import PluginConfig, PluginConfigError, SessionConfig, load_plugin_config


def test_defaults_file_and_inline_keys_merge(tmp_path):
    assert load_plugin_config(None) == PluginConfig()
    f = tmp_path / "kvs.toml"
    f.write_text('instance = "kvs9"\nnamespace = "t1"\n[sessions]\npolicy = "best_effort"\nchunk_max_blocks = 8\n'
                 'budget_s = 1\n')
    cfg = load_plugin_config({"backend_name": "kvsidecar", "interface_v1": 1, "prefetch_threshold": 256,
                              "config_file": str(f), "timeout_s": 0.5, "sessions": {"chunk_max_blocks": 16}})
    assert cfg.instance == "kvs9" and cfg.namespace == "t1" and cfg.timeout_s == 0.5
    assert cfg.sessions == SessionConfig(policy="best_effort", chunk_max_blocks=16, budget_s=1.0)


@pytest.mark.parametrize("text, match", [
    ('instanse = "x"\n', "unknown key 'instanse'"),
    ('[sessions]\npolicy = "eager"\n', "sessions.policy"),
    ('[sessions]\nchunk_max_blocks = "8"\n', "chunk_max_blocks must be int"),
    ('l3 = 1\n', "l3 must be bool"),
    ('[sessions]\nbudget_s = -1.0\n', "budget_s"),
    ('populate = "eager"\n', "populate"),
    ('[sessions\n', "cannot read"),
    ('[sessions]\nsettle_wait_s = -0.1\n', "settle_wait_s"),
    ('[sessions]\nsettle_wait_s = 5\n', "settle_wait_s"),
])
def test_bad_config_is_a_typed_error_naming_the_key(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(PluginConfigError, match=match):
        load_plugin_config({"config_file": str(f)})


def test_missing_file_and_bad_inline_values(tmp_path):
    with pytest.raises(PluginConfigError, match="cannot read"):
        load_plugin_config({"config_file": str(tmp_path / "nope.toml")})
    with pytest.raises(PluginConfigError, match="timeout_s must be float"):
        load_plugin_config({"timeout_s": "2"})
    with pytest.raises(PluginConfigError, match="sessions must be a table"):
        load_plugin_config({"sessions": "timeout"})


def test_settling_is_on_by_default_and_can_be_turned_off(tmp_path):
    assert SessionConfig().settle_wait_s == 0.02
    f = tmp_path / "off.toml"
    f.write_text("[sessions]\nsettle_wait_s = 0\n")
    assert load_plugin_config({"config_file": str(f)}).sessions.settle_wait_s == 0.0
