"""``python -m k3ckpt.testing.hub DIR --repo ID``: serve directories until interrupted (see
:func:`k3ckpt.testing.hub.main`)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
