"""`python -m pp_tp.cli` = the `pp-tp` command."""

from pp_tp.cli import main

raise SystemExit(main())
