"""Shared pytest setup. Fixtures live in tests/fixtures/, one module per area."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.redis",
]
