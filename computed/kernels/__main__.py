import sys

from computed.kernels import main

sys.exit(main())
