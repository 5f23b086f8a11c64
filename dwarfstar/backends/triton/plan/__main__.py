import sys

from dwarfstar.backends.triton.plan.report import main

sys.exit(main())
