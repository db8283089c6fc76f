"""`python -m migrations`: see migrations/cli.py."""

from migrations.cli import main

raise SystemExit(main())
