"""`python -m fakes.demo` (what `make demo` runs): the driver end to end against the fakes."""

import sys

from fakes.demo.run import main

sys.exit(main())
