"""`python -m app.bench` = `ppserve bench engine`."""

import sys

from app.bench.engine import main

sys.exit(main())
