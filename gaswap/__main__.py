import sys

from gaswap.app.cli import main

sys.exit(main())
