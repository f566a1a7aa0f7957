import sys

from gaswap.cli import main

sys.exit(main())
