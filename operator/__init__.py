"""kvfleet.operator: kopf handlers, rendering of children, autoscaler. Never imports torch."""
