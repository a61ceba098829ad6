import sys

from ostinato.entrypoints.cli import main

sys.exit(main())
