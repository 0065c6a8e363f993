"""`python -m qrt ...`: the command line (the same as the `qrt` script)."""

import sys

from qrt.cli import main

sys.exit(main())
