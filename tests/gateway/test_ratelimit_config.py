"""The rate limits file: parsing (JSON, TOML), per-key overrides by key or digest, and reload
keeping the old limits on a bad file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.ratelimit_config import Limit, LimitsFile, RateLimitConfigError, key_hash, load_limits, parse_limits


def test_defaults_and_overrides() -> None:
    digest = key_hash("sk-b")
    limits = parse_limits({"default": {"requests_per_minute": 60, "tokens_per_minute": 1000},
                           "keys": {"sk-a": {"requests_per_minute": 5},
                                    f"sha256:{digest.upper()}": {"tokens_per_minute": None}}})
    assert limits.window_s == 60.0
    assert limits.for_key(None) == ("anonymous", Limit(60, 1000))
    assert limits.for_key("sk-a") == (key_hash("sk-a"), Limit(5, 1000))
    assert limits.for_key("sk-b") == (digest, Limit(60, None))
    assert limits.for_key("other") == (key_hash("other"), Limit(60, 1000))
    assert "sk-a" not in repr(limits)  # only digests are held


def test_empty_file_means_unlimited() -> None:
    limits = parse_limits({})
    assert limits.default.unlimited and not limits.keys


@pytest.mark.parametrize("data", [
    [], {"default": {"requests_per_minute": 0}}, {"default": {"requests_per_minute": 1.5}},
    {"default": {"requests_per_minute": True}}, {"default": {"rpm": 3}}, {"limits": {}},
    {"keys": {"sha256:abc": {}}}, {"keys": {"": {}}}, {"keys": []}, {"window_seconds": 0},
    {"window_seconds": "60"}, {"keys": {"k": 5}},
])
def test_bad_content(data: object) -> None:
    with pytest.raises(RateLimitConfigError):
        parse_limits(data)


def test_error_never_shows_the_key() -> None:
    with pytest.raises(RateLimitConfigError) as info:
        parse_limits({"keys": {"sk-secret-value": {"requests_per_minute": -1}}})
    assert "sk-secret-value" not in str(info.value)


def test_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "limits.toml"
    toml.write_text('window_seconds = 1\n[default]\nrequests_per_minute = 2\n[keys."sk-a"]\ntokens_per_minute = 9\n')
    limits = load_limits(toml)
    assert limits.window_s == 1.0 and limits.for_key("sk-a")[1] == Limit(2, 9)
    bad = tmp_path / "limits.json"
    bad.write_text("{not json")
    with pytest.raises(RateLimitConfigError):
        load_limits(bad)
    with pytest.raises(RateLimitConfigError):
        load_limits(tmp_path / "missing.json")


def _write(path: Path, data: object, stamp: int) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    os.utime(path, ns=(stamp, stamp))  # a distinct mtime per write, whatever the clock's resolution


def test_reload(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    _write(path, {"default": {"requests_per_minute": 1}}, 1_000_000_000)
    file = LimitsFile(path)
    assert file.limits.default == Limit(1, None)
    assert not file.reload()  # unchanged
    _write(path, {"default": {"requests_per_minute": 2}}, 2_000_000_000)
    assert file.reload() and file.limits.default == Limit(2, None)
    _write(path, "{broken", 3_000_000_000)
    assert not file.reload() and file.limits.default == Limit(2, None)  # the old limits stay
    assert not file.reload(force=True) and file.limits.default == Limit(2, None)
    path.unlink()
    assert not file.reload() and file.limits.default == Limit(2, None)
    _write(path, {"default": {"tokens_per_minute": 7}}, 4_000_000_000)
    assert file.reload() and file.limits.default == Limit(None, 7)
    assert file.reload(force=True) and file.reloads == 3  # SIGHUP re-reads an unchanged file


def test_bad_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    path.write_text('{"default": {"requests_per_minute": "many"}}')
    with pytest.raises(RateLimitConfigError):
        LimitsFile(path)


def test_bad_toml(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    path.write_text("[default\nrequests_per_minute = 1\n")
    with pytest.raises(RateLimitConfigError):
        load_limits(path)
