"""`python -m moemesh.cli ...`: how the local launcher starts each service process."""

import sys

from moemesh.cli import main

sys.exit(main())
