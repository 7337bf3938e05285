"""`python -m switchyard serve --from <reference>` (also `.venv/bin/switchyard serve ...`)."""

from __future__ import annotations

import sys

from switchyard import serve


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        sys.exit("usage: switchyard serve --from <registry>/<repository>:<tag> [--plain-http] [make run's flags]")
    serve.main(sys.argv[2:])


if __name__ == "__main__":
    main()
