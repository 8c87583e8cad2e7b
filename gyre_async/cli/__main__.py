import sys

from gyre_async.cli.main import main

sys.exit(main())
