"""`python -m jbackends`: print the environment and backends report."""

import sys

from jbackends._src.report import main

sys.exit(main())
