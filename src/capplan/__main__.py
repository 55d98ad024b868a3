"""`python -m capplan`: the same command as `capplan`."""

from capplan.cli import main

main()
