import sys

from computed.backend.kernels import main

sys.exit(main())
