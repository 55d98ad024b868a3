"""Console entry point `capplan`."""

from __future__ import annotations


def main() -> None:  # pragma: no cover - exercised through subprocess tests
    from capplan.cli import main as typer_main

    typer_main()
