"""`pagedserve up --name`: it becomes part of engine and gateway ids, so only a short plain name
is taken; anything else is refused at parse time with the reason."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.launch.up import add_arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", ["a", "fleet-2", "east_1", "A" * 40])
def test_a_plain_name_is_taken(name: str) -> None:
    assert _parse("--name", name).name == name


def test_the_default_keeps_the_engine_ids_of_one_up() -> None:
    assert _parse().name == "up"  # engines up-engine-0 / up-engine-1, as before --name


@pytest.mark.parametrize("name", ["", "-a", "a b", "a:b", "a/b", "é", "A" * 41])
def test_other_names_are_refused_with_the_reason(name: str) -> None:
    with pytest.raises(argparse.ArgumentError, match="letters, digits"):
        _parse(f"--name={name}")
