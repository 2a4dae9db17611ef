"""``python -m optq``: the same as the ``optq`` console script."""

import sys

if __name__ == "__main__":
    try:
        from .cli import main
    except KeyboardInterrupt:  # Ctrl-C while the interpreter loads the command line
        print("optq: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
