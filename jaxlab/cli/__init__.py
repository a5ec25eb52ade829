"""The ``jaxlab`` command line: Typer commands and Rich views only (parse, call, render)."""
