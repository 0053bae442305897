"""Every `kvfleet bench` program of the runtime (the kernels' own live in `kvfleet.kernels.bench`)
and the command that registers them all."""
