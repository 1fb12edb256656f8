"""``python -m cockpit``: the ``cockpit`` command (:mod:`cockpit.cli`)."""

import sys

from cockpit.cli import main

if __name__ == "__main__":
    sys.exit(main())
