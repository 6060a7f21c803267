"""`servetwin compare` and `servetwin calibrate`: the simulator against measured torch runs."""
