"""`python -m proxy` is `mmgate`."""

from proxy.cli import main

main()
