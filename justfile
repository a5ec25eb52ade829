# Contributor recipes. `just` is optional: each recipe is one pdm command.
set shell := ["bash", "-euo", "pipefail", "-c"]

default:
    @just --list

# Install the locked environment (all groups) into .venv
install:
    python3 -m pip install -q "pdm==2.29.4" "hishel[httpx2]>=1.4,<2"
    pdm install -G:all --frozen-lockfile

# Whole test suite (slow tests included, as CI runs it)
test *ARGS:
    pdm run test {{ARGS}}

# Everything but the tests marked slow
test-fast *ARGS:
    pdm run pytest -m "not slow" {{ARGS}}

# ruff format --check + ruff check
lint:
    pdm run lint

# Format and autofix
fmt:
    pdm run fmt

# pyright
typecheck:
    pdm run typecheck

# The end-to-end proof a reviewer runs first
reproduce *ARGS:
    pdm run jaxlab reproduce --cpu {{ARGS}}

# Benchmark suites (see docs/benchmarking.md)
bench *ARGS:
    pdm run jaxlab bench {{ARGS}}

# Serve a run directory: just serve artifacts/runs/<id>
serve RUN_DIR *ARGS:
    pdm run jaxlab serve --run-dir {{RUN_DIR}} {{ARGS}}

# What CI runs
ci:
    bash .ci/run
