"""``python3 -m controller ...`` is the ``edgetb`` command."""
import sys

from controller.cli import main

sys.exit(main())
