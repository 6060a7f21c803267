"""Scheduling: vLLM 0.33's scheduler, its waiting queues, its config and the SchedulerOutput it emits."""
