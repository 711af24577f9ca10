"""`python -m clients.cli`: the `tokenstream` command."""

import sys

from clients.cli import main

sys.exit(main())
