"""`python -m mlxinfer ...` is the `mlxinfer` command."""

import sys

from .cli import main

sys.exit(main())
