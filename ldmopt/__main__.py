import sys

from ldmopt.cli import main

sys.exit(main())
