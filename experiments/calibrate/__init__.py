"""Measuring on the torch backend (threads, warm-up, contention) and the CPU cost-model calibration built on
it: fitting it, the automatic first-use calibration and its cache key."""
