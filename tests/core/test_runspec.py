"""A node's agent gets its job's RunConfig as data: what ``stead run`` parsed comes back whole, with the settings of
the agent's own environment, and a missing or malformed spec is one clear ConfigError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stead.cli.run_args import parse_run_args
from stead.core.errors import ConfigError
from stead.core.runspec import RUN_SPEC_ENV, RunConfig, read_spec, spec_text


def _config(tmp_path: Path) -> RunConfig:
    (tmp_path / "train.py").write_text("")
    return parse_run_args(["--nnodes", "1:2", "--nproc-per-node", "2", "--redirects", "1:3", "--tee", "2",
                           "--local-ranks-filter", "0", "--rdzv-conf", "join_timeout=5", "--set", "ckpt.keep_last=2",
                           "--job-name", "spec", "train.py", "--lr", "0.1"], cwd=str(tmp_path), environ={})


def test_the_spec_an_agent_reads_is_the_run_config_stead_run_parsed(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert read_spec(spec_text(config), environ={}) == config


def test_the_agent_resolves_settings_from_its_own_environment_and_the_spec_s_overrides(tmp_path: Path) -> None:
    config = _config(tmp_path)
    text = spec_text(config)
    assert "settings\"" not in text.replace("settings_overrides", "")  # only the overrides travel
    read = read_spec(text, environ={"STEAD_HEARTBEAT_TIMEOUT_S": "42", "STEAD_JOIN_TIMEOUT_S": "9"})
    assert read.settings.heartbeat_timeout_s == 42.0  # the agent's own variable
    assert read.settings.join_timeout_s == 5.0  # the spec's override (--rdzv-conf join_timeout=5) wins


@pytest.mark.parametrize(("text", "says"), [
    (None, f"{RUN_SPEC_ENV} is not set"),
    ("", f"{RUN_SPEC_ENV} is not set"),
    ("['train.py']", f"{RUN_SPEC_ENV} is not JSON"),
    ("[1, 2]", f"{RUN_SPEC_ENV} is not a JSON object"),
    ('{"min_nodes": 1}', f"{RUN_SPEC_ENV} does not hold a run spec"),
])
def test_a_missing_or_malformed_spec_is_one_clear_error(text: str | None, says: str) -> None:
    with pytest.raises(ConfigError, match="started by `stead run` or a platform") as caught:
        read_spec(text, environ={})
    assert str(caught.value).startswith(says)


def test_a_field_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    data = json.loads(spec_text(_config(tmp_path)))
    data["min_nodes"] = "two"
    with pytest.raises(ConfigError, match="min_nodes"):
        read_spec(json.dumps(data), environ={})
