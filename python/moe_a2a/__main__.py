"""`python -m moe_a2a`: the `moe-a2a` command."""

import sys

from moe_a2a.cli import main

sys.exit(main())
