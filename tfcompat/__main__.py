"""``python -m tfcompat`` and the ``tfcompat`` command: see :mod:`._tools.cli`."""

import sys


def main(argv=None):
    try:
        from ._tools.cli import main as run
    except ImportError:  # a copy vendored with --no-tools
        print("tfcompat: this copy was vendored without its tools (tfcompat vendor --no-tools); for report and "
              "check, run `python -m tfcompat` from the tfcompat checkout it was copied from (its VENDORED file names "
              "the commit); to update this copy, run `tfcompat vendor <this folder> --no-tools` from a newer "
              "checkout", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
