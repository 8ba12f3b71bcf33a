"""`python -m proxy` is `mmgate`."""

from .cli import main

main()
