"""The LoRA flags of `pagedserve engine` / `up`: `--lora-modules` in both forms, bad entries refused
by argparse, the EngineConfig they make, and `up` passing them on to its engine."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from engine.worker.cli import add_arguments, engine_config, lora_flags


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_both_forms_reach_the_config() -> None:
    chat = json.dumps({"name": "chat", "path": "/a/chat", "base_model_name": "m"})
    args = _parse("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "8", "--max-lora-rank", "32",
                  "--lora-modules", "sql=/a/sql", chat)
    config = engine_config(args, "/models/m")
    assert config.enable_lora and config.lora_modules == {"sql": "/a/sql", "chat": "/a/chat"}
    assert (config.max_loras, config.max_cpu_loras, config.max_lora_rank) == (4, 8, 32)
    assert lora_flags(args) == ["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "4",
                                "--max-lora-rank", "32", "--max-cpu-loras", "8"]
    assert engine_config(_parse(), "/models/m").lora_modules is None


@pytest.mark.parametrize("entry", ["sql", "=/a", "sql=", '{"name": "x"}', '{"path": "/a"}', "{not json"])
def test_bad_entries_are_refused(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--enable-lora", "--lora-modules", entry)
    assert "--lora-modules" in capsys.readouterr().err


def test_relative_paths_are_made_absolute_for_up() -> None:
    args = _parse("--enable-lora", "--lora-modules", "sql=adapters/sql")
    assert lora_flags(args)[2] == f"sql={os.path.abspath('adapters/sql')}"
