"""``python -m minisrv.train``: train CityLM; with ``--draft``, its draft model instead."""

import sys

if "--draft" in sys.argv[1:]:
    from minisrv.train.draft import main

    main([arg for arg in sys.argv[1:] if arg != "--draft"])
else:
    from minisrv.train.citylm import main

    main()
