"""`python -m loadgen`: the load generator's command line."""

import sys

from loadgen.cli import main

sys.exit(main())
