"""Testbed drivers: step traces, scenario files, lockstep replay and the wall-clock (realtime) loop."""
