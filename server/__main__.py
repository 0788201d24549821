import sys

from labkit.server.launch import main

sys.exit(main())
