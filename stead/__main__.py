"""``python -m stead`` is the ``stead`` command."""

import sys

from stead.cli import main

sys.exit(main())
