import sys

from sm120kit.cli import main

sys.exit(main())
