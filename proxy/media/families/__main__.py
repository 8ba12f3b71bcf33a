import sys

from proxy.media.families import main

sys.exit(main())
