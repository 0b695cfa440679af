"""``CommConfig``: validation, timedelta timeouts, ``COMMLIB_TIMEOUT`` and its warning."""

from __future__ import annotations

import dataclasses
import datetime
import math
import warnings

import pytest

from commlib.config import DEFAULT_TIMEOUT_S, CommConfig


def test_defaults() -> None:
    assert DEFAULT_TIMEOUT_S == 300.0
    assert CommConfig().timeout == 300.0


@pytest.mark.parametrize("value", [1, 0.5, 12.25, 10**6])
def test_numeric_timeout_is_kept(value: float) -> None:
    assert CommConfig(timeout=value).timeout == value


@pytest.mark.parametrize(
    ("delta", "seconds"),
    [
        (datetime.timedelta(seconds=90), 90.0),
        (datetime.timedelta(minutes=30), 1800.0),
        (datetime.timedelta(milliseconds=250), 0.25),
    ],
)
def test_timedelta_becomes_seconds(delta: datetime.timedelta, seconds: float) -> None:
    config = CommConfig(timeout=delta)  # type: ignore[arg-type]
    assert config.timeout == seconds
    assert isinstance(config.timeout, float)


@pytest.mark.parametrize(
    "value", [0, -1, -0.5, float("nan"), datetime.timedelta(0), datetime.timedelta(seconds=-3)]
)
def test_non_positive_timeout_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"CommConfig\.timeout: must be > 0 seconds, got ") as info:
        CommConfig(timeout=value)  # type: ignore[arg-type]
    shown = str(info.value).rsplit("got ", 1)[1]
    expected = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    assert shown == str(expected)


@pytest.mark.parametrize(
    ("value", "type_name"), [("30", "str"), (True, "bool"), (None, "NoneType"), ([1], "list")]
)
def test_non_numeric_timeout_is_a_type_error(value: object, type_name: str) -> None:
    with pytest.raises(TypeError, match=rf"CommConfig\.timeout: expected seconds .* got {type_name}$"):
        CommConfig(timeout=value)  # type: ignore[arg-type]


def test_infinite_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        CommConfig(timeout=math.inf)


def test_config_is_frozen_and_keyword_only() -> None:
    config = CommConfig(timeout=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        CommConfig(5)  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout_s'"):
        CommConfig(timeout_s=5)  # type: ignore[call-arg]


def test_configs_compare_by_value() -> None:
    assert CommConfig(timeout=datetime.timedelta(seconds=5)) == CommConfig(timeout=5.0)
    assert dataclasses.replace(CommConfig(), timeout=7).timeout == 7


# ------------------------------------------------------------- from_env
def test_from_env_without_variable_gives_default() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CommConfig.from_env({}).timeout == DEFAULT_TIMEOUT_S
        assert CommConfig.from_env({"COMMLIB_TIMEOUT": ""}).timeout == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize(("text", "seconds"), [("12.5", 12.5), ("60", 60.0), (" 7 ", 7.0), ("1e3", 1000.0)])
def test_from_env_parses_commlib_timeout(text: str, seconds: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CommConfig.from_env({"COMMLIB_TIMEOUT": text}).timeout == seconds


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("abc", "could not convert"),
        ("-1", "must be > 0"),
        ("0", "must be > 0"),
        ("nan", "must be > 0"),
        ("5s", ""),
    ],
)
def test_bad_commlib_timeout_warns_and_uses_default(text: str, reason: str) -> None:
    with pytest.warns(RuntimeWarning) as record:
        config = CommConfig.from_env({"COMMLIB_TIMEOUT": text})
    assert config.timeout == DEFAULT_TIMEOUT_S
    assert len(record) == 1
    message = str(record[0].message)
    assert f"environment variable COMMLIB_TIMEOUT: unexpected value {text!r}" in message
    assert reason in message
    assert "using 300.0" in message


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMLIB_TIMEOUT", "42")
    assert CommConfig.from_env().timeout == 42.0


def test_overrides_win_over_environment() -> None:
    environ = {"COMMLIB_TIMEOUT": "5"}
    assert CommConfig.from_env(environ, timeout=7).timeout == 7
    assert CommConfig.from_env(environ, timeout=datetime.timedelta(minutes=1)).timeout == 60.0
    # None means "not given": the environment applies.
    assert CommConfig.from_env(environ, timeout=None).timeout == 5.0


def test_bad_override_is_still_validated() -> None:
    with pytest.raises(ValueError, match=r"must be > 0 seconds, got -2"):
        CommConfig.from_env({}, timeout=-2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk'"):
        CommConfig.from_env({}, chunk=3)
