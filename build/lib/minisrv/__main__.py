"""``python -m minisrv serve|bench``: see ``minisrv.server.cli``."""

from minisrv.server.cli import main

if __name__ == "__main__":
    main()
