"""``python -m jaxlab`` is the same as the ``jaxlab`` command."""

from jaxlab.cli.app import run

if __name__ == "__main__":
    run()
