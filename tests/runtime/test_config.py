"""Tests for ``orchestr.config``: ``ORCHESTR_*`` variables, overrides and validation."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from orchestr.config import Config, load_config
from orchestr.errors import ConfigError, OrchestrError


def test_empty_environment_gives_the_defaults() -> None:
    config = load_config({})
    assert config == Config()
    assert config.call_timeout == 60.0
    assert config.max_message_bytes == 64 * 1024 * 1024
    assert config.bind_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("var", "raw", "field", "expected"),
    [
        ("ORCHESTR_CALL_TIMEOUT", "2.5", "call_timeout", 2.5),
        ("ORCHESTR_CALL_TIMEOUT", "30", "call_timeout", 30.0),
        ("ORCHESTR_MAX_MESSAGE_BYTES", "1024", "max_message_bytes", 1024),
        ("ORCHESTR_BIND_HOST", "0.0.0.0", "bind_host", "0.0.0.0"),
        ("ORCHESTR_HEARTBEAT_INTERVAL", "0.25", "heartbeat_interval", 0.25),
        ("ORCHESTR_HEARTBEAT_TIMEOUT", "12", "heartbeat_timeout", 12.0),
        ("ORCHESTR_WORKER_START_TIMEOUT", "1e2", "worker_start_timeout", 100.0),
        ("ORCHESTR_WORKER_STOP_GRACE", " 7.5 ", "worker_stop_grace", 7.5),
        ("ORCHESTR_DEATH_REPORT_WAIT", "0.001", "death_report_wait", 0.001),
    ],
)
def test_environment_variable_sets_its_field(
    var: str, raw: str, field: str, expected: object
) -> None:
    config = load_config({var: raw})
    value = getattr(config, field)
    assert value == expected
    assert type(value) is type(expected)


def test_every_field_has_a_variable(tmp_path: pathlib.Path) -> None:
    pem = tmp_path / "any.pem"
    pem.write_text("PEM")  # load_config checks only that the files can be read
    strings = {
        "bind_host": "10.0.0.1",
        "transport_fallback": "error",
        "local_call_transport": "shm",
        "fabric": "static",
        "tls_cert": str(pem),
        "tls_key": str(pem),
        "tls_ca": str(pem),
        "metrics_token": "s3cret",
    }
    environ = {
        f"ORCHESTR_{f.name.upper()}": (strings[f.name] if f.type == "str" else "7")
        for f in dataclasses.fields(Config)
    }
    config = load_config(environ)
    for field in dataclasses.fields(Config):
        assert getattr(config, field.name) != getattr(Config(), field.name), field.name


def test_secrets_are_not_passed_on_to_started_processes() -> None:
    from orchestr.config import config_environ

    passed = config_environ(load_config(metrics_token="s3cret"))
    assert "ORCHESTR_METRICS_TOKEN" not in passed and "s3cret" not in passed.values()


def test_transport_fallback_takes_only_known_policies() -> None:
    with pytest.raises(ConfigError, match="ORCHESTR_TRANSPORT_FALLBACK|allow, error"):
        load_config({"ORCHESTR_TRANSPORT_FALLBACK": "sometimes"})


def test_unrelated_variables_are_ignored() -> None:
    assert load_config({"PATH": "/bin", "ORCHESTR_CALL_TIMEOUTS": "nope"}) == Config()


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("ORCHESTR_CALL_TIMEOUT", "soon"),
        ("ORCHESTR_CALL_TIMEOUT", ""),
        ("ORCHESTR_CALL_TIMEOUT", "2.5s"),
        ("ORCHESTR_MAX_MESSAGE_BYTES", "1.5"),
        ("ORCHESTR_MAX_MESSAGE_BYTES", "64MiB"),
        ("ORCHESTR_MAX_MESSAGE_BYTES", "1e6"),
        ("ORCHESTR_HEARTBEAT_TIMEOUT", "five"),
    ],
)
def test_unparseable_value_raises_config_error_naming_the_variable(var: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({var: raw})
    assert var in str(info.value)
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("ORCHESTR_CALL_TIMEOUT", "0"),
        ("ORCHESTR_CALL_TIMEOUT", "-1"),
        ("ORCHESTR_CALL_TIMEOUT", "-0.0"),
        ("ORCHESTR_CALL_TIMEOUT", "nan"),
        ("ORCHESTR_MAX_MESSAGE_BYTES", "0"),
        ("ORCHESTR_MAX_MESSAGE_BYTES", "-5"),
        ("ORCHESTR_HEARTBEAT_INTERVAL", "0"),
        ("ORCHESTR_WORKER_STOP_GRACE", "-3"),
    ],
)
def test_non_positive_number_is_refused_naming_the_setting(var: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({var: raw})
    assert var.removeprefix("ORCHESTR_").lower() in str(info.value).lower()


def test_overrides_take_precedence_over_the_environment() -> None:
    config = load_config({"ORCHESTR_CALL_TIMEOUT": "5"}, call_timeout=7.0, bind_host="::1")
    assert (config.call_timeout, config.bind_host) == (7.0, "::1")


def test_bad_environment_value_is_reported_even_when_overridden() -> None:
    with pytest.raises(ConfigError, match="ORCHESTR_CALL_TIMEOUT"):
        load_config({"ORCHESTR_CALL_TIMEOUT": "x"}, call_timeout=7.0)


def test_unknown_override_name_is_refused_and_named() -> None:
    with pytest.raises(ConfigError, match="call_timout"):
        load_config({}, call_timout=3.0)


def test_several_unknown_overrides_are_all_named() -> None:
    with pytest.raises(ConfigError, match="alpha, beta"):
        load_config({}, beta=1, alpha=2)


@pytest.mark.parametrize(("field", "value"), [("call_timeout", 0.0), ("max_message_bytes", -1)])
def test_non_positive_override_is_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config({}, **{field: value})


@pytest.mark.parametrize(("field", "value"), [("call_timeout", "5"), ("max_message_bytes", None)])
def test_override_of_the_wrong_type_raises_config_error(field: str, value: object) -> None:
    # errors.py: every error the runtime raises derives from OrchestrError.
    with pytest.raises(OrchestrError, match=field):
        load_config({}, **{field: value})


def test_config_constructor_validates_too() -> None:
    with pytest.raises(ConfigError, match="heartbeat_timeout"):
        Config(heartbeat_timeout=0)


def test_config_is_frozen() -> None:
    config = load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.call_timeout = 1.0  # type: ignore[misc]


def test_explicit_environ_ignores_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTR_CALL_TIMEOUT", "99")
    assert load_config({}).call_timeout == 60.0
    assert load_config().call_timeout == 99.0


def test_config_round_trips_through_the_environment() -> None:
    from orchestr.config import config_environ

    config = load_config(call_timeout=2.5, transport_fallback="error", inline_max_bytes=4096)
    assert load_config(config_environ(config)) == config


def test_fabric_takes_managed_or_static() -> None:
    assert load_config({"ORCHESTR_FABRIC": "static"}).fabric == "static"
    with pytest.raises(ConfigError, match="fabric must be one of managed, static"):
        load_config({"ORCHESTR_FABRIC": "sometimes"})
