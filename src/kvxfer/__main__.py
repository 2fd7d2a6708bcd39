"""``python -m kvxfer``: the same command as ``kvxfer``."""

import sys

from kvxfer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
