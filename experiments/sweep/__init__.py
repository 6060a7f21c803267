"""`servetwin sweep`: a grid of runs on a pool of workers (local processes or Ray)."""
