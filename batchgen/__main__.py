"""`python -m batchgen ...`: the same as the `batchgen` command."""

from batchgen.cli import main

raise SystemExit(main())
