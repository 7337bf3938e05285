"""The `switchyard` command (`pip install .`, or .venv/bin/switchyard): run the stack, serve a
published pipeline, or build the CPU worker's kernels."""

from __future__ import annotations

import sys

USAGE = """usage: switchyard run [make run's flags]                 the whole stack on the default model
       switchyard serve --from <registry>/<repository>:<tag> [--plain-http] [make run's flags]
       switchyard build-kernels [--force]                  the CPU worker's C kernels, once per host"""


def main() -> None:
    command, argv = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if command == "run":
        from switchyard import launcher

        launcher.main(argv)
    elif command == "serve":
        from switchyard import serve

        serve.main(argv)
    elif command == "build-kernels":
        from services.worker.backends.torch_cpu.kernels import build

        build.main(argv)
    elif command in ("-h", "--help", "help"):
        print(USAGE)
    else:
        sys.exit(USAGE)


if __name__ == "__main__":
    main()
