"""`kvfleet demo`: the command (`cmd_demo`, imported by every `kvfleet` run, so light), the
autoscaling demo it runs and the request load and plot that demo uses."""
