"""`python -m pp_tp.cli` = the `pp-tp` command."""

from pp_tp.cli.main import main

raise SystemExit(main())
