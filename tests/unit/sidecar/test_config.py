"""sidecar/config.py and the launcher's flag handling."""

import pytest

from kvsidecar.sidecar.config import ConfigError, load_config
from kvsidecar.sidecar.app import parse_overrides


def test_toml_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('instance = "kvst-x"\n[transport]\nnum_slots = 4\nsidecar_spin_us = 10\n')
    cfg = load_config(p, {"transport.ring_bytes": 8192, "transport.max_frame_bytes": 2048})
    assert cfg.instance == "kvst-x"
    assert cfg.transport.num_slots == 4
    assert cfg.transport.sidecar_spin_us == 10.0
    assert cfg.transport.ring_bytes == 8192
    assert cfg.control_name == "/kvst-x.ctl"


@pytest.mark.parametrize("text,overrides,msg", [
    ("bogus = 1\n", {}, "unknown key 'bogus'"),
    ("[transport]\nnum_slots = 'four'\n", {}, "expected int"),
    ("", {"transport.ring_bytes": 5000}, "power of two"),
    ("", {"transport.num_slots": 0}, "num_slots"),
    ("", {"instance": "a/b"}, "instance"),
    ("[transport\n", {}, "c.toml"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, overrides, msg):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_config(p, overrides)


def test_parse_overrides():
    assert parse_overrides(["a.b=3", "c=true", "d=hello", 'e="x y"']) == {"a.b": 3, "c": True, "d": "hello", "e": "x y"}
    with pytest.raises(SystemExit):
        parse_overrides(["novalue"])
