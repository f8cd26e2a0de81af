import sys

from moejax.perf.cli import main

sys.exit(main())
