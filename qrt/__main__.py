"""`python -m qrt ...`: the command line (the same as the `qrt` script)."""

import sys

from qrt.runtime.cli import main

sys.exit(main())
