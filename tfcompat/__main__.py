"""``python -m tfcompat`` and the ``tfcompat`` command: see :mod:`._tools.cli`."""

import sys


def main(argv=None):
    try:
        from ._tools.cli import main as run
    except ImportError:  # a copy vendored with --no-tools
        print("tfcompat: this copy was vendored without its tools (tfcompat vendor --no-tools); run the command of "
              "an installed tfcompat (pip install tfcompat) for report, check and vendor", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
