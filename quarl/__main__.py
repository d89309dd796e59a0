import sys

from quarl.cli import main

sys.exit(main())
