"""`python -m strata` and the `strata` script. Ctrl-C while the command's modules are still being
imported ends it as quietly as later on (strata.cli.main): no traceback."""

import sys


def run() -> None:
    try:
        from strata.cli import main
    except KeyboardInterrupt:
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
