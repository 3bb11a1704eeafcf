"""``python -m jaxmp.cli``: the same as the ``jaxmp`` console script."""

import sys

from jaxmp.cli import main

sys.exit(main())
